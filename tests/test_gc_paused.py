"""Building records pauses the cyclic collector; it must leave the host's own GC state as it found it."""

from __future__ import annotations

import gc

from kvdiag.diagnostics.turn_loader import gc_paused


def test_host_frozen_objects_stay_frozen() -> None:
    gc.freeze()  # a host that froze its objects before forking workers
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= frozen, "gc_paused thawed the host's frozen objects"
        assert len(made) == 1000
    finally:
        gc.unfreeze()


def test_collector_state_restored() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_records_made_while_paused_leave_the_young_generations() -> None:
    assert gc.get_freeze_count() == 0
    with gc_paused():
        made = [[i] for i in range(10_000)]
    # moved to the oldest generation: the next young collection does not walk them
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert not any(id(m) in young for m in made)
    assert any(m is made[0] for m in gc.get_objects(generation=2))
