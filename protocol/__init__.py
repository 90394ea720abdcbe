"""The contract between evenflow's processes: messages, codec, version. Depends on nothing else."""

from .codec import Codec, DecodeError, MAX_FRAME_BYTES
from .messages import *  # noqa: F401,F403  (every message type is part of the public contract)
from .version import PROTOCOL_VERSION
