"""Config errors: one line each, naming the setting, the value, its source and what is allowed."""

from __future__ import annotations

import logging

import pytest

import engine.entrypoints.openai.main
from engine.entrypoints.cli.main import main


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in list(__import__("os").environ):
        if name.startswith("KILN_") and name != "KILN_CACHE_DIR":
            monkeypatch.delenv(name)


@pytest.fixture
def fake_serve(monkeypatch):
    seen = {}
    monkeypatch.setattr(engine.entrypoints.openai.main, "serve", lambda e, s, **_: seen.update(engine=e, server=s) or 0)
    return seen


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln: error")]


def test_bad_flag_value_names_the_flag(fake_serve, capsys):
    assert main(["serve", "--max-model-len", "lots"]) == 2
    (line,) = errors(capsys)
    assert "max_model_len = 'lots' (from --max-model-len)" in line and "integer" in line
    assert "pydantic" not in line


def test_bad_choice_says_what_is_allowed(fake_serve, capsys, monkeypatch):
    monkeypatch.setenv("KILN_PREEMPTION_MODE", "sometimes")
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "preemption_mode = 'sometimes' (from KILN_PREEMPTION_MODE)" in line
    assert "'auto', 'swap' or 'recompute'" in line


def test_bad_env_value_names_the_variable(fake_serve, capsys, monkeypatch):
    monkeypatch.setenv("KILN_MAX_NUM_SEQS", "0")
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "max_num_seqs = '0' (from KILN_MAX_NUM_SEQS)" in line and "greater than or equal to 1" in line


def test_bad_toml_value_names_file_and_line(fake_serve, capsys, tmp_path):
    (tmp_path / "kiln.toml").write_text("# comment\nmax_num_seqs = 4\nblock_size = 7\n")
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "block_size = 7 (from kiln.toml:3)" in line and "8, 16, 32, 64, 128" in line


def test_unknown_toml_key_names_file_line_and_suggests(fake_serve, capsys, tmp_path):
    (tmp_path / "kiln.toml").write_text("max_num_seq = 4\n")
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "kiln.toml:1: unknown setting 'max_num_seq' (did you mean 'max_num_seqs'?)" in line


def test_toml_syntax_error_names_the_file(fake_serve, capsys, tmp_path):
    (tmp_path / "kiln.toml").write_text("max_num_seqs = = 4\n")
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "kiln.toml: TOML syntax error" in line


def test_server_settings_accepted_in_toml(fake_serve, tmp_path):
    (tmp_path / "kiln.toml").write_text('port = 9000\nmax_num_seqs = 3\nserved_model_name = ["a"]\n')
    assert main(["serve"]) == 0
    assert (fake_serve["server"].port, fake_serve["engine"].max_num_seqs) == (9000, 3)
    assert fake_serve["server"].served_model_name == ["a"]


def test_missing_kiln_config_file_is_an_error(fake_serve, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CONFIG", str(tmp_path / "nope.toml"))
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert "KILN_CONFIG=" in line and "no such file" in line


def test_kiln_config_names_the_file_in_errors(fake_serve, capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "prod.toml"
    cfg.write_text("max_num_seqs = 4\nport = 99999\n")
    monkeypatch.setenv("KILN_CONFIG", str(cfg))
    assert main(["serve"]) == 2
    (line,) = errors(capsys)
    assert f"port = 99999 (from {cfg}:2)" in line


def test_unknown_kiln_variable_is_warned_with_a_suggestion(fake_serve, monkeypatch, caplog):
    monkeypatch.setenv("KILN_MAX_NUM_SEQ", "4")
    with caplog.at_level(logging.WARNING):
        assert main(["serve"]) == 0
    assert "KILN_MAX_NUM_SEQ is not a kiln setting and is ignored (did you mean 'KILN_MAX_NUM_SEQS'?)" in caplog.text


def test_flags_beat_env_beat_toml(fake_serve, monkeypatch, tmp_path):
    (tmp_path / "kiln.toml").write_text("max_num_seqs = 3\nblock_size = 32\nport = 9001\n")
    monkeypatch.setenv("KILN_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("KILN_PORT", "9002")
    assert main(["serve", "--max-num-seqs", "7"]) == 0
    e, s = fake_serve["engine"], fake_serve["server"]
    assert (e.max_num_seqs, e.block_size, s.port) == (7, 32, 9002)


def test_combination_errors_are_one_line(fake_serve, capsys):
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    (line,) = errors(capsys)
    assert "enable_auto_tool_choice needs tool_call_parser" in line


def test_build_kernels_uses_the_cache_root_serve_uses(monkeypatch, tmp_path):
    import compiler.kernels.cli
    from engine.config.settings import EngineSettings

    calls = []
    monkeypatch.setattr(compiler.kernels.cli, "build_main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "root"))
    assert main(["build-kernels", "--list"]) == 0
    assert calls[-1] == ["--list", "--cache-dir", str(tmp_path / "root" / "kernels")]
    assert EngineSettings().resolved_kernel_cache_dir() == tmp_path / "root" / "kernels"  # where serve looks
    assert main(["build-kernels", "--cache-dir", str(tmp_path / "other"), "--jobs", "2"]) == 0
    assert calls[-1] == ["--jobs", "2", "--cache-dir", str(tmp_path / "other" / "kernels")]
    assert main(["build-kernels", "--kernel-cache-dir", str(tmp_path / "k")]) == 0
    assert calls[-1] == ["--cache-dir", str(tmp_path / "k")]
    # --cpu: the C++ CPU libraries, into the compile cache serve loads them from
    import compiler.kernels.cpu_prebuild
    from engine.runtime import builder_cpu_crossover as cpu_crossover

    cpu_calls, measured = [], []
    monkeypatch.setattr(compiler.kernels.cpu_prebuild, "main", lambda argv: cpu_calls.append(argv) or 0)
    monkeypatch.setattr(cpu_crossover, "measure_for_build", lambda *dirs: measured.append(dirs) or 0)
    assert main(["build-kernels", "--cpu", "--all"]) == 0 and len(calls) == 3
    assert cpu_calls[-1] == ["--all", "--into", str(tmp_path / "root" / "compile")]
    assert measured == []  # (a wheel's build for every level: no machine to measure)
    assert EngineSettings().resolved_compile_cache_dir() == tmp_path / "root" / "compile"
    assert main(["build-kernels", "--cpu", "--compile-cache-dir", str(tmp_path / "c")]) == 0
    assert cpu_calls[-1] == ["--into", str(tmp_path / "c")]
    # then this machine's crossover from the kernels to the GEMM, cached in kiln's cache root
    assert measured == [(tmp_path / "c", tmp_path / "root")]
