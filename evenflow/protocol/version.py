"""Protocol version: bumped on any incompatible change to evenflow/protocol/messages.py."""

PROTOCOL_VERSION = 4
