"""Distributed checkpoints (safetensors per rank plus one metadata file); see
:mod:`disttensor.checkpoint.state_dict`."""
from .state_dict import METADATA_FILE, load_state_dict, save_state_dict

__all__ = ["save_state_dict", "load_state_dict", "METADATA_FILE"]
