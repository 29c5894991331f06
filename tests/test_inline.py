"""inline.py: which table callables a row writes in, and that what it writes does what the call did."""
from __future__ import annotations

import types

import attrs

from kvplane.statemachines import events as E
from kvplane.statemachines.inline import field_aliases, inline_expression, inline_statements, read_fields_for_aliases
from kvplane.statemachines.machines import MACHINES

ARGS = ("inst", "ev", "cfg", "now")
LIMIT = 10


def plain_guard(r, ev, cfg, now):
    """a docstring is dropped"""
    return r.count < LIMIT and ev.request_id in r.ids


def keyed(r, ev, cfg, now):
    return {k: v for k, v in r.items} == {x: x for x in r.ids}


def _helper(r, ev, cfg, now):
    r.count += 1


def effect(r, ev, cfg, now):
    """Counts twice: once here, once in the helper it hands its arguments to."""
    total = r.count + 1
    r.count = total
    _helper(r, ev, cfg, now)


def with_default(r, ev, cfg, now=0.0):
    return r.count


def rebinds(r, ev, cfg, now):
    now = now + 1
    r.count = now


def returns_early(r, ev, cfg, now):
    if r.count:
        return
    r.count = 1


STATE = {"n": 0}


def reads_mutable_global(r, ev, cfg, now):
    return STATE["n"]


def _closure():
    limit = 3
    return lambda r, ev, cfg, now: r.count < limit


TWO_ON_ONE_LINE = (lambda r, ev, cfg, now: r.count, lambda r, ev, cfg, now: r.count)


class Rec:
    def __init__(self):
        self.count, self.ids, self.items = 0, ("a",), (("a", "a"),)


def run(lines: list[str], scope: dict, rec: Rec, ev, expression: bool = False):
    body = [f"    return {lines[0]}"] if expression else ["    " + line for line in lines]
    code = "def row(inst, ev, cfg, now):\n" + "\n".join(body) + "\n"
    exec(code, scope)
    return scope["row"](rec, ev, None, 0.0)


def test_a_plain_expression_is_written_in_with_its_globals_bound_privately():
    scope: dict = {}
    text = inline_expression(plain_guard, ARGS, scope, "g0")
    assert text == "(inst.count < _g0_LIMIT and ev.request_id in inst.ids)"
    assert scope == {"_g0_LIMIT": LIMIT}
    ev = E.StartLoad(request_id="a")
    assert run([text], scope, Rec(), ev, expression=True) is plain_guard(Rec(), ev, None, 0.0) is True


def test_comprehension_targets_are_locals_and_builtins_are_bound():
    scope: dict = {}
    text = inline_expression(keyed, ARGS, scope, "g1")
    assert text is not None and "_g1_k" in text and "_g1_x" in text
    assert run([text], scope, Rec(), None, expression=True) is True


def test_an_effect_is_spliced_with_the_one_it_hands_its_arguments_to():
    scope: dict = {}
    lines = inline_statements(effect, ARGS, scope, "e0")
    assert lines == ["_e0_total = inst.count + 1", "inst.count = _e0_total", "inst.count += 1"]
    rec = Rec()
    run(lines, scope, rec, None)
    called = Rec()
    effect(called, None, None, 0.0)
    assert rec.count == called.count == 2


def test_what_cannot_be_written_in_stays_a_call():
    for fn in (with_default, rebinds, returns_early, reads_mutable_global, _closure(), *TWO_ON_ONE_LINE, len,
               types.SimpleNamespace):
        assert inline_expression(fn, ARGS, {}, "x") is None, fn
        assert inline_statements(fn, ARGS, {}, "x") is None, fn


def test_the_real_machines_write_in_most_of_their_callables():
    """The decode lifecycle's hottest rows call nothing of the table's."""
    m = MACHINES["lease"]
    heartbeat = m._handle_rows["LEASED"][E.LeaseHeartbeat]
    names = set(heartbeat.__code__.co_names)
    assert not {"g1", "e1", "e2", "dl1"} & names, names  # renewable, _extend (with _bind), _bind, the expiry
    read_done = MACHINES["decode_request"]._handle_rows["READING"][E.ReadDone]
    assert not any(n.startswith("b0_") for n in read_done.__code__.co_names)


@attrs.define(slots=True)
class _WithProperties(E.Event):
    request_id: str
    consumer: str

    @property
    def sender(self) -> str:  # reads a field: aliased
        return self.consumer

    @property
    def shouted(self) -> str:  # computes: stays a property
        return self.consumer.upper()

    @property
    def elsewhere(self) -> str:  # reads no field of its own
        return self.__class__.__name__


def test_a_property_that_reads_one_field_is_read_as_that_field():
    assert field_aliases(_WithProperties) == {"sender": "consumer"}
    assert field_aliases(E.ConsumerDone) == {"sender": "consumer"}
    body = ["    if ev.sender is not None and ev.shouted:", "        ev.sender.strip()", "    x = ev.sender"]
    assert read_fields_for_aliases(body, _WithProperties) == [
        "    if ev.consumer is not None and ev.shouted:", "        ev.consumer.strip()", "    x = ev.consumer"]
    # The lease's completion row reads the field, no property (its guards and _bind say ev.sender).
    done = MACHINES["lease"]._handle_rows["LEASED"][E.ConsumerDone]
    assert "sender" not in done.__code__.co_names and "consumer" in done.__code__.co_names
