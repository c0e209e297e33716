from libs.common.service import main
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService

main(DecodeService, DecodeConfig)
