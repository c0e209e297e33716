from libs.common.service import main
from services.cache_store.config import CacheStoreConfig
from services.cache_store.service import CacheStoreService

main(CacheStoreService, CacheStoreConfig)
