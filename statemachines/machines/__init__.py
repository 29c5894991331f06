"""The compiled machines.  Compiling validates: an invalid table fails at import."""
from ..machine import compile_machine
from . import decode_request, engine_request, heartbeat, lease, push_write, remote_engine

SPECS = {m.SPEC.name: m.SPEC for m in (decode_request, lease, remote_engine, push_write, heartbeat)}
MACHINES = {name: compile_machine(spec) for name, spec in SPECS.items()}
# The scheduler half's machine: run in a plane of its own (connector.scheduler).
ENGINE_MACHINES = {engine_request.SPEC.name: compile_machine(engine_request.SPEC)}
# Every machine an event log may name (a rank's plane, or the scheduler half's).
LOGGED_MACHINES = {**MACHINES, **ENGINE_MACHINES}
