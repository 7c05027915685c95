"""slime's own `--sglang-*` flags, which are slime's settings and not SGLang server arguments
(every other `--sglang-*` passes through to SGLang): before, they went to SGLang's parser, and
failed only when the engines started (`--server-concurrency`: no such server argument) or, for
`--sglang-config`, would be read by SGLang's own `--config` as a server-argument file (it is read
as slime reads it: tests/test_slime_sglang_config.py). `--sglang-server-concurrency` is in four of
slime's scripts (Kimi-K2 x3, DeepSeek-R1), `--sglang-config` in its GLM-5.2 script."""

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError


def test_server_concurrency_is_per_engine_as_in_slime():
    # scripts/run-kimi-k2-Instruct.sh (a slime run: SGLang): 32 nodes x 8 GPUs colocated, 16 GPUs per engine: 16 engines
    cfg, _ = parse_config(["--sglang-server-concurrency", "1024", "--rollout-engine", "sglang", "--rollout-num-gpus-per-engine", "16",
                           "--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--colocate"])
    assert cfg.rollout.max_concurrency == 1024 * 16 and "server-concurrency" not in cfg.sglang_args
    cfg, _ = parse_config(["--sglang-server-concurrency", "8", "--rollout-engine", "sglang", "--rollout-num-gpus", "4",
                           "--rollout-num-gpus-per-engine", "2"])
    assert cfg.rollout.max_concurrency == 16 and cfg.sglang_args == {}
    assert parse_config(["--sglang-server-concurrency", "8", "--num-engines", "3"])[0].rollout.max_concurrency == 24
    assert parse_config(["--sglang-server-concurrency", "8"])[0].rollout.max_concurrency == 8  # one embedded engine
    with pytest.raises(ConfigError, match="--sglang-server-concurrency 8: requests per engine, but the number of "
                                          "engines is not given"):
        parse_config(["--sglang-server-concurrency", "8", "--rollout-engine", "sglang"])
    with pytest.raises(ConfigError, match="--sglang-server-concurrency 8: 16 requests .* --max-concurrency 10"):
        parse_config(["--sglang-server-concurrency", "8", "--num-engines", "2", "--max-concurrency", "10"])


def test_slimes_router_and_config_flags_are_not_sglang_server_arguments():
    cfg, _ = parse_config(["--sglang-router-request-timeout-secs", "30"])
    assert cfg.rollout.request_timeout_s == 30 and cfg.sglang_args == {}
    for flag, why in (("--sglang-router-ip", "--rollout-engine-urls URL"),
                      ("--sglang-router-port", "--rollout-engine-urls URL")):
        with pytest.raises(ConfigError, match=f"^{flag}: not supported by agentrl: .*{why}"):
            parse_config([flag, "x"])
    with pytest.raises(ConfigError, match="^--sglang-config x: no such file"):  # read by agentrl, not SGLang
        parse_config(["--sglang-config", "x"])
    # a real SGLang server argument still passes through
    assert parse_config(["--sglang-mem-fraction-static", "0.7"])[0].sglang_args == {"mem-fraction-static": "0.7"}
