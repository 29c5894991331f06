"""The compiled machines.  Compiling validates: an invalid table fails at import."""
from ..machine import compile_machine
from . import decode_request, heartbeat, lease, push_write, remote_engine

SPECS = {m.SPEC.name: m.SPEC for m in (decode_request, lease, remote_engine, push_write, heartbeat)}
MACHINES = {name: compile_machine(spec) for name, spec in SPECS.items()}
