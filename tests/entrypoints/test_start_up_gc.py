"""`kiln serve` defers the collector's full collections through start-up (issue 40: ~3 of them walked
torch's ~220,000 objects for nothing) and puts its thresholds back once ready, before freezing."""

from __future__ import annotations

import gc

from engine.entrypoints.cli import main as cli
from engine.entrypoints.openai import main as server


def test_serve_starts_without_full_collections_and_gets_the_thresholds_back(monkeypatch):
    seen = {}

    def fake_serve(engine_settings, server_settings, gc_thresholds=None):
        seen["during"], seen["handed"] = gc.get_threshold(), gc_thresholds
        server.freeze_start_up_objects(gc_thresholds)  # (what serve() does once ready)
        seen["after"] = gc.get_threshold()
        return 0

    before = gc.get_threshold()
    monkeypatch.setattr(server, "serve", fake_serve)
    try:
        args = cli.build_parser().parse_args(["serve", "some-model"])
        assert cli._cmd_serve(args) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert seen["during"] == (before[0], before[1], cli.NO_FULL_COLLECTION)
    assert seen["handed"] == before and seen["after"] == before
    # a serve that ends before ready (or raises) leaves the thresholds as they were
    monkeypatch.setattr(server, "serve", lambda e, s, **_: 0)
    assert cli._cmd_serve(args) == 0 and gc.get_threshold() == before
