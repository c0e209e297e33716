from libs.common.service import main
from services.cache_master.config import CacheMasterConfig
from services.cache_master.service import CacheMasterService

# A deposed leader exits: its supervisor (compose, Kubernetes, make run) starts a standby.
main(lambda config: CacheMasterService(config, exit_on_step_down=True), CacheMasterConfig)
