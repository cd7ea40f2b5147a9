"""Distributed checkpoints (safetensors per rank plus one metadata file); see
:mod:`disttensor.checkpoint.state_dict`. ``save``/``load`` are PyTorch's DCP names for
``save_state_dict``/``load_state_dict``."""
from .dcp import load, save
from .state_dict import METADATA_FILE, load_state_dict, save_state_dict

__all__ = ["save_state_dict", "load_state_dict", "METADATA_FILE", "save", "load"]
