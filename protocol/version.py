"""Protocol version: bumped on any incompatible change to protocol/messages.py."""

PROTOCOL_VERSION = 1
