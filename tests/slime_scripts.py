"""slime's launch scripts -> the arguments they give train.py / train_async.py, built as bash
builds them: the model file (scripts/models/*.sh) sourced, the script's arrays defined, and its
train line expanded. Nothing of the script runs but those assignments (its `pkill`, `ray start`
lines never do), and, given a scratch folder, the here-documents it writes into its `mktemp` files
(GLM-5.2's --sglang-config YAML), written there instead. Used by tests/test_slime_scripts.py; run
as a program it refreshes the checked-in copies under tests/data/slime_scripts/ from a slime checkout:

    python tests/slime_scripts.py SLIME_DIR
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = {  # name -> the script, at slime 624b824
    "qwen3-4B": "scripts/run-qwen3-4B.sh",
    "qwen3-30B-A3B": "scripts/run-qwen3-30B-A3B.sh",
    "search-r1": "examples/search-r1/run_qwen2.5_3B.sh",
    "retool": "examples/retool/retool_qwen3_4b_rl.sh",
    "fully-async": "examples/fully_async/run-qwen2.5-0.5B-fully_async.sh",
}
OTHER_SCRIPTS = {  # checked in too, each tested on its own (tests/test_slime_opd.py)
    "opd": "examples/on_policy_distillation/run-qwen3-8B-opd.sh",
}
DATA = Path(__file__).parent / "data" / "slime_scripts"
ENV = {"NUM_GPUS": "8", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # WANDB_KEY unset, as on a fresh shell


def script_args(slime: Path, script: str, scratch: Path | None = None) -> list[str]:
    text = (slime / script).read_text()
    model = re.search(r'^source\s+"?([^"\n]*models/[^"\n/]+\.sh)"?', text, re.M).group(1)
    lines = [f'source "{slime / "scripts" / "models" / Path(model).name}"']
    lines += [m.group(0) for m in re.finditer(r"^[A-Z_]+=\$\{[^\n]*$", text, re.M)]  # NAME=${NAME:-default}
    # NAME=literal (TEACHER_IP="127.0.0.1"): no command substitution, nothing bash would run
    lines += [m.group(1) for m in re.finditer(r"""^([A-Z_]+=(?:"[^"$`\\\n]*"|'[^'\n]*'|[^\s"'$`;&|()<>#]+))[ \t]*(?:#.*)?$""",
                                              text, re.M)]
    for i, m in enumerate(re.finditer(r"^([A-Z_]+)=\$\(mktemp [^)\n]*\)[ \t]*$", text, re.M) if scratch else ()):
        name, path = m.group(1), scratch / f"{Path(script).stem}_{i}"
        doc = re.search(rf'^cat > "?\$\{{?{name}\}}?"? <<(\w+)\n(.*?)^\1$', text, re.M | re.S)
        if doc and "$" in doc.group(2):
            raise RuntimeError(f"{script}: the here-document of {name} expands variables; not written as it is")
        path.write_text(doc.group(2) if doc else "")
        lines.append(f"{name}={path}")
    # the arrays (run-mimo-7B-rl-eagle.sh indents one: ` CKPT_ARGS=(` ... ` )`), an empty one too: in file order,
    # so geo3k's `else WANDB_ARGS=()` (WANDB_API_KEY unset) empties the array its `if` branch fills
    lines += [m.group(0) for m in re.finditer(r"^[ \t]*[A-Z_]+=\((?:[ \t]*\)[ \t]*$|[ \t]*\n.*?^[ \t]*\))", text,
                                              re.M | re.S)]
    tail = re.search(r"python3 train(?:_async)?\.py \\\n(.*?)(?:\n\s*\n|\Z)", text, re.S).group(1)
    words = " ".join(line.rstrip("\\").strip() for line in tail.splitlines() if not line.strip().startswith("#"))
    lines.append(f"printf '%s\\n' {words}")
    out = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, env=ENV, timeout=60,
                         cwd=slime / Path(script).parent)
    if out.returncode:
        raise RuntimeError(f"{script}: bash failed: {out.stderr}")
    return out.stdout.splitlines()


def array_flags(slime: Path) -> list[str]:
    """Every flag in the argument arrays (`NAME=( ... )`, comments dropped) of slime's scripts/
    and examples/ shell files: what its scripts hand train.py / train_async.py."""
    flags = set()
    for sh in sorted([*slime.glob("scripts/**/*.sh"), *slime.glob("examples/**/*.sh")]):
        for array in re.finditer(r"^[A-Z_]+=\([ \t]*\n(.*?)^\)", sh.read_text(), re.M | re.S):
            body = "\n".join(line.split("#")[0] for line in array.group(1).splitlines())
            flags.update(re.findall(r"(?:^|\s)(--[a-z][a-z0-9-]*)", body))
    return sorted(flags)


def parser_flags(slime: Path) -> list[str]:
    """Every flag slime's own parser defines (slime/utils/arguments.py)."""
    return sorted(set(re.findall(r'"(--[a-z0-9-]+)"', (slime / "slime" / "utils" / "arguments.py").read_text())))


def checked_in(name: str) -> list[str]:
    return (DATA / f"{name}.args").read_text().splitlines()


if __name__ == "__main__":
    DATA.mkdir(parents=True, exist_ok=True)
    for name, script in {**SCRIPTS, **OTHER_SCRIPTS}.items():
        (DATA / f"{name}.args").write_text("\n".join(script_args(Path(sys.argv[1]), script)) + "\n")
    (DATA / "all_flags.txt").write_text("\n".join(array_flags(Path(sys.argv[1]))) + "\n")
    (DATA / "slime_arguments_flags.txt").write_text("\n".join(parser_flags(Path(sys.argv[1]))) + "\n")


SLIME_COMMIT = "624b824"
SLIME_GIT = os.environ.get("AGENTRL_SLIME_GIT", "/work/.mirror/THUDM+slime/repo")


def slime_checkout(tmp: Path) -> Path | None:
    """slime's whole tree at SLIME_COMMIT: AGENTRL_SLIME_SRC, else extracted from the git mirror
    (AGENTRL_SLIME_GIT) into `tmp`; None where there is neither."""
    if os.environ.get("AGENTRL_SLIME_SRC"):
        return Path(os.environ["AGENTRL_SLIME_SRC"])
    if not Path(SLIME_GIT).is_dir():
        return None
    archive = subprocess.run(["git", "--git-dir", SLIME_GIT, "archive", SLIME_COMMIT], capture_output=True,
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True, timeout=120)
    return tmp


# The HF config.json of each script's model (the values of its Hugging Face release), so the
# model-shape flags are checked against what the script was written for.
_QWEN3_4B = dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000,
                 vocab_size=151936, tie_word_embeddings=True, hidden_act="silu", max_position_embeddings=40960)
_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
               tie_word_embeddings=True, hidden_act="silu", max_position_embeddings=32768)
HF_CONFIGS = {
    "qwen3-4B": _QWEN3_4B,
    "retool": {**_QWEN3_4B, "rope_theta": 5000000},  # the script's --rotary-base 5000000: its SFT model's
    "qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, rms_norm_eps=1e-6, rope_theta=1000000,
                          vocab_size=151936, tie_word_embeddings=False, hidden_act="silu",
                          max_position_embeddings=40960),
    "search-r1": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                      num_attention_heads=16, num_key_value_heads=2),
    "opd": {**_QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},  # Qwen3-8B
    "fully-async": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2),
}
HOOK_DIRS = ["", "examples/search-r1", "examples/retool"]  # on sys.path, as the scripts' PYTHONPATH puts them
