"""Every `vllm serve` flag (vLLM 0.32.0's parser, tests/data/vllm_serve_flags.json, made by
tools/vllm_flags_dump.py) parses on `kiln serve` with a value of vLLM's shape, and is answered as
engine/entrypoints/cli/vllm_flag_table.py says: implemented (its setting is set), no effect (parsed
and logged), or refused (a one-line error naming the capability). Parse only: no engine starts."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from engine.config.server_settings import ServerSettings
from engine.config.sources import SettingsError
from engine.entrypoints.cli.flags import DEST_PREFIX, normalize_argv, settings_from_args
from engine.entrypoints.cli.main import build_parser
from engine.entrypoints.cli.vllm_compat import DATA_PARALLEL, GIVEN, check_vllm_flags, log_no_effect, replicas_argv
from engine.entrypoints.cli.vllm_flag_table import (
    IMPLEMENTED,
    NO_EFFECT,
    OLDER_FLAGS,
    REFUSED,
    VLLM_ALIASES,
    VLLM_FLAGS_TABLE,
)

ROOT = Path(__file__).resolve().parents[2]
DUMP = json.loads((ROOT / "tests" / "data" / "vllm_serve_flags.json").read_text())
FLAGS = {f["options"][0]: f for f in DUMP["flags"]}
JSON_TYPES = {"loads", "parse_dataclass", "union_dict_and_str", "_parse_type"}
# vLLM-valid values where the generic rule below would not give one (no default, no choices).
# Each value here and each the rules make was checked against vLLM 0.32.0's own parser.
EXAMPLES = {
    "--tool-call-parser": "hermes",
    "--reasoning-parser": "qwen3",
    "--quantization": "fp8",
    "--attention-backend": "FLASH_ATTN",
    "--block-size": "16",
    "--tokenizer": "/models/tok",
    "--chat-template": "{{ messages }}",
    "--spec-method": "ngram",
    "--spec-model": "/models/draft",
    "--served-model-name": "m",
    "--lora-modules": "a=/x",
    "--api-key": "sk-1",
    "--host": "0.0.0.0",
    "--root-path": "/kiln",
    "--log-level": "INFO",
    "--kv-cache-memory-bytes": "2G",
    "--config": "flags.yaml",  # (written by the test)
    "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}',
    "--custom-histogram-buckets": "[0.1, 1.0]",
    "--max-log-len": "100",
    "--grpc-port": "50051",
    "--distributed-timeout-seconds": "60",
    "--cpu-distributed-timeout-seconds": "60",
    "--numa-bind-nodes": "0",
    "--max-parallel-loading-workers": "2",
    "--num-gpu-blocks-override": "100",
    "--mamba-block-size": "16",
    "--prefix-match-unit": "16",
    "--kv-offloading-size": "8",
    "--video-pruning-rate": "0.5",
    "--max-cpu-loras": "2",
    "--max-lora-cls-labels": "2",
    "--max-num-scheduled-tokens": "1024",
    "--max-num-active-seqs": "8",
    "--max-num-queued-reqs": "10",
    "--max-num-queued-tokens": "1000",
    "--prefix-cache-retention-interval": "0",
}
JSON_FLAGS = ("--mm-processor-kwargs", "--default-mm-loras")  # (JSON, though the dump's type does not say)
# A vLLM-valid value of each refused flag that asks for what kiln lacks (bool flags: the bare
# flag; choice flags: a choice outside the accepted ones). --quantization-config and
# --diffusion-config have none here (no non-empty value of theirs was found that vLLM parses alone).
ASKING = {
    "--response-role": "user",
    "--tool-parser-plugin": "p.py",
    "--tool-server": "localhost:8000",
    "--sse-keep-alive-interval": "2",
    "--fingerprint-value": "abc",
    "--grpc-port": "50051",
    "--uds": "/tmp/kiln.sock",
    "--middleware": "a.b",
    "--hf-config-path": "/x",
    "--revision": "main",
    "--code-revision": "main",
    "--tokenizer-revision": "main",
    "--tokenizer-mode": "mistral",
    "--config-format": "mistral",
    "--hf-overrides": '{"a": 1}',
    "--model-class-overrides": '{"a": "b"}',
    "--logits-processors": "a.B",
    "--io-processor-plugin": "p",
    "--model-loader-extra-config": '{"a": 1}',
    "--reasoning-parser-plugin": "p.py",
    "--pipeline-parallel-size": "2",
    "--nnodes": "2",
    "--node-rank": "1",
    "--device-ids": "0,1",
    "--decode-context-parallel-size": "2",
    "--prefill-context-parallel-size": "2",
    "--worker-cls": "a.B",
    "--worker-extension-cls": "a.B",
    "--kv-cache-dtype-skip-layers": "0",
    "--cpu-offload-gb": "2",
    "--offload-group-size": "2",
    "--lora-target-modules": "q_proj",
    "--otlp-traces-endpoint": "http://collector:4317",
    "--max-num-scheduled-tokens": "1024",
    "--max-num-active-seqs": "8",
    "--max-num-queued-tokens": "1000",
    "--scheduler-cls": "a.B",
    "--watermark-config": '{"gamma": 0.25}',
    "--kv-transfer-config": '{"engine_id": "e1"}',
    "--kv-events-config": '{"enable_kv_cache_events": true}',
    "--ec-transfer-config": '{"engine_id": "e1"}',
    "--engram-config": '{"cpu_offload": true}',
    "--reasoning-config": '{"reasoning_parser": ""}',
    "--aux-output-config": '{"enable_return_routed_experts": true}',
    "--weight-transfer-config": '{"backend": "nccl"}',
    "--structured-outputs-config": '{"backend": "xgrammar", "disable_any_whitespace": true}',
}
# (args, setting, value) for the spellings older vLLM releases had (absent from 0.32's parser).
OLDER = {
    "--disable-log-requests": (["--disable-log-requests"], "enable_log_requests", False),
    "--guided-decoding-backend": (["--guided-decoding-backend", "xgrammar"], None, None),
    "--max-seq-len-to-capture": (["--max-seq-len-to-capture", "8192"], None, None),
    "--disable-frontend-multiprocessing": (["--disable-frontend-multiprocessing"], None, None),
}


@pytest.fixture(autouse=True)
def _no_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no stray kiln.toml
    for name in list(__import__("os").environ):
        if name.startswith("KILN_") and name != "KILN_CACHE_DIR":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def parser():
    return build_parser()  # (once: a parse is then well under a millisecond)


def vllm_values(flag: dict) -> list[list[str]]:
    """Values of vLLM's shape for a flag: bools bare and --no-; each choice; else an example, the
    default, or 1; JSON configs {}."""
    name, action, default = flag["options"][0], flag["action"], flag["default"]
    if action == "BooleanOptionalAction":
        return [[name], ["--no-" + name.removeprefix("--")]]
    if flag["nargs"] == 0:
        return [[name]]
    if flag["choices"]:
        return [[name, choice] for choice in flag["choices"]]
    if name in EXAMPLES:
        value = EXAMPLES[name]
    elif flag["type"] in JSON_TYPES or name in JSON_FLAGS or name.endswith("-config"):
        value = '["*"]' if str(default).startswith("[") else "{}"
    elif flag["type"] in ("int", "float"):
        value = str(default) if isinstance(default, (int, float)) else "1"
    elif flag["type"] in ("human_readable_int", "human_readable_int_or_auto"):
        value = "1k"
    elif isinstance(default, str) and default and not default.startswith(("<", "[", "set(", "==")):
        value = default
    else:
        value = "x"
    return [[name, value]]


def asking_value(name: str) -> list[str] | None:
    """A vLLM-valid value of a refused flag that asks for what kiln lacks, if there is one here."""
    flag, entry = FLAGS.get(name), VLLM_FLAGS_TABLE[name]
    if flag is None:
        return None
    if flag["nargs"] == 0 or flag["action"] == "BooleanOptionalAction":
        return [name]
    if flag["choices"]:
        return next(([name, c] for c in flag["choices"] if c not in entry.ok), None)
    return [name, ASKING[name]] if name in ASKING else None


def accepted_as_neutral(argv: list[str], ok: tuple[str, ...]) -> bool:
    """Whether the table declares this value one that asks for nothing (bools: the --no- form)."""
    if len(argv) == 1:
        return argv[0].startswith("--no-") and "off" in ok
    text = argv[1].replace(" ", "")
    return text in ok or any(_number(text) == _number(o) is not None for o in ok)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def outcome(parser, argv: list[str]):
    """(kind seen, detail, namespace): a parse error fails here, as an unrecognized flag would."""
    try:
        args = parser.parse_args(normalize_argv(["serve", *argv], parser))
    except SettingsError as exc:  # (a value a vLLM spelling's conversion cannot take)
        return "error", str(exc), None
    try:
        no_effect = check_vllm_flags(args)
    except SettingsError as exc:
        return REFUSED, str(exc), args
    try:
        settings_from_args(args), settings_from_args(args, ServerSettings)
    except SettingsError as exc:
        return "error", str(exc), args
    return NO_EFFECT if no_effect else IMPLEMENTED, no_effect, args


def test_every_vllm_flag_has_an_answer_and_the_counts_per_kind():
    assert DUMP["vllm"] == "0.32.0" and len(FLAGS) == 316
    assert set(FLAGS) | set(OLDER_FLAGS) == set(VLLM_FLAGS_TABLE)
    assert set(OLDER) == set(OLDER_FLAGS)
    kinds = Counter(VLLM_FLAGS_TABLE[name].kind for name in FLAGS)
    assert kinds == {IMPLEMENTED: 64, NO_EFFECT: 164, REFUSED: 88}
    for name, flag in FLAGS.items():  # vLLM's other spellings are known
        for option in flag["options"][1:]:
            assert option.startswith("--no-") or VLLM_ALIASES[option] == name


# Flags that change outputs or capacity: never "no effect" (a sample the table must keep so).
MUST_NOT_BE_NO_EFFECT = [
    "--pipeline-parallel-size", "--enable-prompt-embeds", "--max-model-len", "--data-parallel-size",
    "--max-num-seqs", "--kv-cache-dtype", "--quantization", "--disable-sliding-window", "--logprobs-mode",
    "--cpu-offload-gb", "--kv-offloading-size", "--tokenizer-mode", "--chat-template-content-format",
    "--override-generation-config", "--response-role", "--enable-expert-parallel", "--kv-transfer-config",
]  # fmt: skip


@pytest.mark.parametrize("name", MUST_NOT_BE_NO_EFFECT)
def test_flags_that_change_outputs_or_capacity_are_never_no_effect(name):
    assert VLLM_FLAGS_TABLE[name].kind != NO_EFFECT


def test_each_flag_parses_with_vllm_values_and_gets_its_answer(parser, caplog):
    (Path.cwd() / "flags.yaml").write_text("{}\n")
    seen, refusals, errors = Counter(), set(), []
    for name, flag in FLAGS.items():
        entry = VLLM_FLAGS_TABLE[name]
        asking = asking_value(name) if entry.kind == REFUSED else None
        for argv in vllm_values(flag) + ([asking] if asking and asking not in vllm_values(flag) else []):
            caplog.clear()
            kind, detail, args = outcome(parser, argv)
            where = f"{' '.join(argv)}: {detail}"
            seen[kind] += 1
            if kind == "error":
                errors.append(where)
            if entry.kind == IMPLEMENTED:
                if name == "--attention-backend":  # vLLM's backend names have no effect; kiln's are set
                    assert kind == NO_EFFECT, where
                    continue
                dest = DEST_PREFIX + str(entry.setting) if entry.setting else DATA_PARALLEL
                if name != "--config" and argv[1:] not in (["None"], ["{}"]):  # (vLLM's "unset", "nothing")
                    assert hasattr(args, dest), where
                # A value kiln's setting cannot take is a clear error naming the setting.
                assert kind == IMPLEMENTED or (kind == "error" and str(entry.setting) in detail), where
            elif entry.kind == NO_EFFECT:
                assert kind == NO_EFFECT and name in detail, where
                log_no_effect(detail)
                assert name in caplog.text, where
            elif argv == asking or not accepted_as_neutral(argv, entry.ok):
                assert kind == REFUSED and "\n" not in detail and detail.startswith(argv[0]), where
                if name != "--structured-outputs-config":
                    assert f"kiln does not support {entry.what}" in detail, where
                refusals.add(name)
            else:
                assert kind == NO_EFFECT, where  # (a value that asks for nothing: accepted)
    untested = {n for n in FLAGS if VLLM_FLAGS_TABLE[n].kind == REFUSED} - refusals
    assert untested == {"--quantization-config", "--diffusion-config"}
    # Errors come only from implemented flags, each naming its setting (checked above): values
    # kiln's setting cannot take (--kv-cache-dtype nvfp4, --spec-method mtp) or that need another
    # flag (--lora-modules without --enable-lora).
    assert seen[IMPLEMENTED] > 50 and 0 < len(errors) == seen["error"] < 80


def test_no_effect_flags_are_logged_once_at_start(parser, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.cli.flags"):
        _, no_effect, _ = outcome(
            parser, ["--compilation-config", '{"level": 3}', "--disable-custom-all-reduce", "-cc", "{}"]
        )
        log_no_effect(no_effect)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "--compilation-config, --disable-custom-all-reduce" in lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-pp", "2"], "--pipeline-parallel-size 2: kiln does not support pipeline parallelism"),
        (["-dp", "0"], "--data-parallel-size 0: must be at least 1"),
        (["--enable-prompt-embeds"], "--enable-prompt-embeds: kiln does not support prompt embeddings"),
        (["--kv-offloading-backend", "lmcache"], "KV offloading through LMCache"),
        (["--tokenizer-mode", "mistral"], "tokenizers other than"),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "disable_any_whitespace"),
        (["--structured-outputs-config", '{"backend": "xgrammar", "bakend": "x"}'], "unknown key 'bakend'"),
        (["--structured-outputs-config", '{"backend": "xgramar"}'], "backend 'xgramar' is not one of auto,"),
        (["--structured-outputs-config", '{"reasoning_parser": "qwen3"}'], "--reasoning-parser NAME"),
        (["--load-format", "tensorizer"], "load format 'tensorizer' is not supported: kiln reads auto"),
        (["--pooler-config", '{"normalize": false}'], "kiln takes only pooling_type"),
    ],
)
def test_refusals_name_the_capability(parser, argv, message):
    kind, detail, _ = outcome(parser, argv)
    assert kind in (REFUSED, "error") and message in detail


@pytest.mark.parametrize(
    "argv, neutral",
    [(["-pp", "1"], True), (["--no-enable-prompt-embeds"], True), (["--tokenizer-mode", "hf"], True),
     (["--structured-outputs-config", '{"backend": "xgrammar"}'], True), (["--cpu-offload-gb", "0"], True)],
)  # fmt: skip
def test_values_that_ask_for_nothing_kiln_lacks_are_accepted(parser, argv, neutral):
    kind, _, _ = outcome(parser, argv)
    assert kind == NO_EFFECT


def test_vllm_spellings_set_kiln_settings(parser):
    from engine.entrypoints.cli.main import parse_serve_args

    engine, server = parse_serve_args(
        ["--kv-cache-memory-bytes", "2G", "--max-model-len", "auto", "--spec-method", "ngram", "--spec-tokens", "3"]
        + ["-q", "fp8", "--max-num-queued-reqs", "10", "--cudagraph-capture-sizes", "1", "2", "--async-scheduling"]
        + ["--allow-credentials", "--allowed-methods", '["GET"]', "--allowed-headers", "X-A", "--load-format", "gguf"]
        + ["--override-generation-config", '{"temperature": 0.5}', "--device-memory-utilization", "0.5"]
        + ["--pooler-config", '{"pooling_type": "MEAN"}']
    )
    assert engine.pooling_type == "mean"
    assert (engine.kv_cache_memory_gb, engine.max_model_len, engine.speculative_method) == (2.0, None, "ngram")
    assert (engine.num_speculative_tokens, engine.quantization, engine.max_waiting_requests) == (3, "fp8", 10)
    assert (engine.cuda_graph_sizes, engine.async_scheduling, engine.load_format) == ([1, 2], True, "gguf")
    assert (engine.override_generation_config, engine.gpu_memory_utilization) == ({"temperature": 0.5}, 0.5)
    assert (server.allow_credentials, server.allowed_methods, server.allowed_headers) == (True, ["GET"], ["X-A"])
    engine, _ = parse_serve_args(["--async-scheduling", "false"])
    assert engine.async_scheduling is False
    engine, _ = parse_serve_args(["--async-scheduling", "/models/m"])  # (bare: the MODEL is not its value)
    assert (engine.async_scheduling, engine.model) == (True, "/models/m")


def test_optional_bools_take_a_value_where_argv_is_not_normalized():
    """Benchmarks parse with plain argparse (tools/gpu_check.sh passes `--async-scheduling true`)."""
    import argparse

    from engine.entrypoints.cli.flags import add_settings_flags

    plain = argparse.ArgumentParser()
    add_settings_flags(plain)
    values = [
        getattr(plain.parse_args(a), DEST_PREFIX + "async_scheduling")
        for a in (
            ["--async-scheduling", "true"],
            ["--async-scheduling"],
            ["--async-scheduling=false"],
            ["--no-async-scheduling"],
        )
    ]
    assert values == [True, True, False, False]


@pytest.mark.parametrize("name", sorted(OLDER))
def test_older_vllm_spellings(parser, name):
    argv, setting, value = OLDER[name]
    kind, detail, args = outcome(parser, argv)
    if setting is None:
        assert kind == NO_EFFECT and name in detail
    else:
        assert kind == IMPLEMENTED and getattr(args, DEST_PREFIX + setting) == value
    assert not getattr(args, GIVEN, []) or kind == NO_EFFECT


def test_override_generation_config_goes_over_the_files_defaults():
    from engine.config.generation_config import GenerationDefaults, with_overrides

    base = GenerationDefaults({"temperature": 0.7, "top_p": 0.9}, (2,))
    merged = with_overrides(base, {"temperature": 0.5, "max_new_tokens": 64, "top_k": 0})
    assert merged.sampling == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 64, "top_k": -1}
    assert merged.eos_token_ids == (2,) and with_overrides(base, None) is base
    with pytest.raises(ValueError, match="unknown key"):
        with_overrides(base, {"temprature": 0.5})


def test_data_parallel_size_serves_replicas_behind_a_router(monkeypatch):
    import engine.entrypoints.cli.replicas
    from engine.entrypoints.cli.main import main

    seen = {}
    monkeypatch.setattr(engine.entrypoints.cli.replicas, "main", lambda argv, parse: seen.update(argv=argv) or 0)
    argv = ["serve", "/models/m", "-dp", "3", "--port", "9000", "--host=0.0.0.0", "--max-num-seqs", "4"]
    assert main(argv) == 0
    assert seen["argv"] == [
        "--replicas",
        "3",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "/models/m",
        "--max-num-seqs",
        "4",
    ]
    import engine.entrypoints.openai.main

    seen.clear()
    monkeypatch.setattr(engine.entrypoints.openai.main, "serve", lambda e, s, **_: seen.update(serve=s.port) or 0)
    assert main(["serve", "--data-parallel-size=1", "--port", "9001"]) == 0
    assert seen == {"serve": 9001}  # (one: a plain serve)
    assert replicas_argv(["--data-parallel-size=2", "m", "--port=1"], 2, "h", 5) == [
        "--replicas", "2", "--host", "h", "--port", "5", "m"
    ]  # fmt: skip


def test_vllm_command_line_spellings():
    from engine.entrypoints.cli.main import parse_serve_args
    from engine.entrypoints.cli.vllm_compat import vllm_argv

    argv = ["m", "--max_model_len=4k", "-O3", "--compilation-config.mode", "3", "-cc.pass_config.x=true"]
    argv += ["--served-model-name", "my_model", "--x.on", "--port", "1", "--seed", "-1", "--spec.a=-0.5"]
    assert vllm_argv(argv) == [
        "m", "--max-model-len=4k", "--optimization-level", "3", "--served-model-name", "my_model", "--port", "1",
        "--seed", "-1", "--compilation-config", '{"mode": 3, "pass_config": {"x": true}}', "--x", '{"on": true}',
        "--spec", '{"a": -0.5}',
    ]  # fmt: skip
    engine, _ = parse_serve_args(
        ["--max_num_seqs", "8", "--speculative-config.method", "ngram", "-sc.num_speculative_tokens=3"]
    )
    assert (engine.max_num_seqs, engine.speculative_method, engine.num_speculative_tokens) == (8, "ngram", 3)


def test_kiln_serve_logs_no_effect_flags_once_at_start(monkeypatch, caplog):
    import engine.entrypoints.openai.main
    from engine.entrypoints.cli.main import main

    monkeypatch.setattr(engine.entrypoints.openai.main, "serve", lambda e, s, **_: 0)
    argv = ["serve", "--port", "0", "--disable-custom-all-reduce", "-O3", "--compilation_config.mode=3", "-pp", "1"]
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.cli.flags"):
        assert main(argv) == 0
    lines = [r.getMessage() for r in caplog.records if "no effect in kiln" in r.getMessage()]
    assert lines == [
        "vLLM flags with no effect in kiln (docs/vllm_flags.md says why): --disable-custom-all-reduce, "
        "--optimization-level, --pipeline-parallel-size, --compilation-config"
    ]
    assert main(["serve", "--port", "0", "--enable-prompt-embeds"]) == 2  # (refused: kiln: error: ...)


def all_values() -> list[list[str]]:
    """Every argument list the test above parses (tools/vllm_flags_dump.py --check runs them
    through vLLM's own parser: every one is vLLM-valid for 0.32.0)."""
    cases = []
    for name, flag in FLAGS.items():
        cases += vllm_values(flag)
        asking = asking_value(name) if VLLM_FLAGS_TABLE[name].kind == REFUSED else None
        cases += [asking] if asking and asking not in cases else []
    return cases


def test_tls_client_certificates_and_ciphers_reach_uvicorn():
    from engine.entrypoints.cli.main import parse_serve_args
    from engine.entrypoints.openai.http_options import uvicorn_options

    tls = ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    _, server = parse_serve_args([*tls, "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--ssl-ciphers", "HIGH"])
    options = uvicorn_options(server)
    assert (options["ssl_ca_certs"], options["ssl_cert_reqs"], options["ssl_ciphers"]) == ("ca.pem", 2, "HIGH")
    assert "ssl_ca_certs" not in uvicorn_options(parse_serve_args(tls)[1])
    with pytest.raises(SettingsError, match="need ssl_keyfile"):
        parse_serve_args(["--ssl-ca-certs", "ca.pem"])
    with pytest.raises(SettingsError, match="ssl_cert_reqs needs ssl_ca_certs"):
        parse_serve_args([*tls, "--ssl-cert-reqs", "2"])


if __name__ == "__main__":
    print(json.dumps(all_values()))
