# flash_attn resolved to flashattn, for running another project's tests against it unchanged.
import sys
import flashattn
import flashattn.flash_attn_interface
import flashattn.bert_padding
from flashattn import *  # noqa: F401,F403
from flashattn.flash_attn_interface import *  # noqa: F401,F403

sys.modules["flash_attn.flash_attn_interface"] = flashattn.flash_attn_interface
sys.modules["flash_attn.bert_padding"] = flashattn.bert_padding
__version__ = "2.8.3"
