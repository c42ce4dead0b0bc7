"""Start-up feedback while weights load: progress lines (no terminal) or a bar (a terminal), and the time."""

from __future__ import annotations

import io
import logging
import re

import torch

from engine.models.config import ModelConfig
from engine.models.loader import load_progress
from engine.models.loader.model_loader import load_model
from tests.support.gguf_writer import write_gguf

LOGGER = "engine.models.loader.load_progress"


def _load(path):
    return load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)


def test_safetensors_load_logs_progress_and_time(tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr(load_progress, "PROGRESS_INTERVAL_S", 0.0)  # a line per tensor
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = _load(tiny_llama)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    total = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    assert re.match(rf"loading weights from {re.escape(str(tiny_llama))}: 1 file, ", lines[0])
    progress = [line for line in lines if line.startswith("loading weights: ")]
    num_tensors = len([n for n in model.state_dict()])  # fused q/k/v, gate/up: fewer than the checkpoint's
    assert len(progress) > num_tensors // 2
    assert all("%) " in line or "%)," in line for line in progress)
    percents = [float(re.search(r"\((\d+)%\)", line).group(1)) for line in progress]
    assert percents == sorted(percents) and 90 <= percents[-1] <= 100  # (the header's bytes are not tensors)
    assert total > 0
    done = lines[-1]
    assert re.match(r"loaded \d+ tensors \(.+\) from .+ in \d+\.\ds \(.+/s\)$", done), done


def test_no_progress_lines_between_intervals(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _load(tiny_llama)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and lines[0].startswith("loading weights from") and lines[1].startswith("loaded ")


def test_gguf_load_counts_tensors(tiny_llama, tmp_path, caplog, monkeypatch):
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", "F32")
    monkeypatch.setattr(load_progress, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _load(path)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    m = re.match(r"loading weights from .+: 1 file, (\d+) tensors$", lines[0])
    assert m, lines[0]
    loaded = int(re.match(r"loaded (\d+) tensors ", lines[-1]).group(1))
    assert 0 < loaded <= int(m.group(1))  # (a GGUF may hold tensors kiln computes itself: rope factors)
    assert lines[-2].startswith(f"loading weights: {loaded} of {m.group(1)} (")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_bar(caplog):
    term = _Terminal()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        progress = load_progress.LoadProgress("ckpt", 3000, 2, stream=term)
        for _ in range(3):
            progress.advance(1000)
        seconds = progress.finish()
    assert "\rloading weights:" in term.getvalue() and "2.93k" in term.getvalue()  # a bar over the bytes
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines[0] == "loading weights from ckpt: 2 files, 2.9 KiB"
    assert not any(line.startswith("loading weights: ") for line in lines)  # the bar, not lines
    assert lines[-1].startswith("loaded 3 tensors (2.9 KiB) from ckpt in ") and seconds >= 0


def test_the_bar_ends_at_its_total_when_tensors_load_elsewhere(caplog):
    """A GGUF whose quantised tensors another path loads: the bar still reaches its total (it
    stopped at 62 of 272 on a Q4 file)."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        progress = load_progress.LoadProgress("m.gguf", 272, 1, unit="tensors", stream=_Terminal())
        bar = progress.bar
        for _ in range(62):
            progress.advance(10)
        progress.loaded_elsewhere(272 - progress.tensors)
        assert bar.n == bar.total == 272
        progress.finish()
