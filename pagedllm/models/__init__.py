from .config import ModelConfig
from .decoder import DecoderForCausalLM

__all__ = ["DecoderForCausalLM", "ModelConfig"]
