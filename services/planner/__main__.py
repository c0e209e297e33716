from libs.common.service import main
from services.planner.config import PlannerConfig
from services.planner.service import PlannerService

main(PlannerService, PlannerConfig)
