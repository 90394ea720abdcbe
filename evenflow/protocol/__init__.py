"""The contract between evenflow's processes: messages, codec, version (and ``hf_config``, the checkpoint
config reader every part uses). Depends on nothing else."""

from evenflow.protocol.codec import Codec, DecodeError, MAX_FRAME_BYTES
from evenflow.protocol.messages import *  # noqa: F401,F403  (every message type is part of the public contract)
from evenflow.protocol.stats import *  # noqa: F401,F403
from evenflow.protocol.worker_messages import *  # noqa: F401,F403
from evenflow.protocol.version import PROTOCOL_VERSION
from evenflow.protocol.speculative import SPECULATIVE_METHODS, SpeculativeConfig, parse_speculative_config
