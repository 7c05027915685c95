"""Weight sync from the trainer into real SGLang servers, with agentrl's own code
(`agentrl.weight_transfer`, the Megatron trainer's bucketed HF export): seconds and GB/s per full
sync, and after each sync the check that the engine serves the trainer's weights. Not a test:
it prints and saves figures (`--out DIR/weight_sync.json`, written after every step).

Three paths, the ones the training loop can take:
  colocated    trainer and engine on GPU 0: /update_weights_from_tensor (CUDA IPC handles,
               `sync_weights_from_tensor`), by bucket size;
  distributed  trainer on GPU 0, engine on GPU 1: /init_weights_update_group + NCCL broadcast +
               /update_weights_from_distributed (`WeightUpdateGroup`), by bucket size;
  disk         `save_hf` + /update_weights_from_disk (`sync_weights_from_disk`).

Every sync sends new weights: before each one the trainer's parameters are set to the initial
ones plus fresh Gaussian noise (std --noise), so an engine that kept its old weights fails the
check. The check: the engine samples 2 fixed prompts x 32 tokens at temperature 1 and its
logprobs are compared with the trainer's own (`compute_logprobs`) for the same tokens; on SGLang also every weight
tensor's hash (/weights_checker "checksum", SGLang's own fused qkv / gate_up tensors) against
the same hash of the trainer's exported tensors, fused the same way.

The model: a random-init Qwen2.5-1.5B-shaped checkpoint (28 layers, hidden 1536, FFN 8960,
12/2 heads, vocab 151936, tied embeddings) with a byte-level tokenizer over the full vocab,
written first (no network on the GPU machines).

    # GPU machine with 2 GPUs, .sgl carried (see bench/results/weight_sync.md):
    python3 bench/weight_sync_gpu.py --out $OUT
    # CPU smoke run: tiny model, two embedded engines, gloo instead of NCCL, fp32:
    python bench/weight_sync_gpu.py --out /tmp/ws --engine embedded --device cpu --shape tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
VOCAB = 151936
T0 = time.monotonic()


def log(*a):
    print(f"[{time.monotonic() - T0:7.1f}s]", *a, flush=True)


def sync_device(dev: str):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


# -- the checkpoint --------------------------------------------------------------------------
def make_tokenizer(d: Path):
    """Byte-level BPE over the whole vocab: ids 0..255 = the byte symbols, 151643..151645 = Qwen
    specials, every other id = "t<id>" (any text encodes, any id decodes); as ../shared/gpu/random-qwen2.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    for i, ch in enumerate(sorted(ByteLevel.alphabet())):
        del vocab[f"t{i}"]
        vocab[ch] = i
    special = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
    for i, s in special.items():
        del vocab[f"t{i}"]
        vocab[s] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(special.values()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(d)


def make_checkpoint(path: Path, shape: str, dtype: torch.dtype, device: str) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path
    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, **SHAPES[shape])
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    make_tokenizer(tmp)
    tmp.rename(path)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


# -- the engines -----------------------------------------------------------------------------
class Server:
    def __init__(self, name: str, argv: list[str], port: int, log_path: Path):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     process_group=0)  # its own group (killed as one), not a new session
        self.started = time.monotonic()
        self.ready_s = None

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except Exception:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except Exception:
                    pass
        self.log_file.close()


def start_server(args, name: str, gpu: int, port: int, mem: float, model: Path, out: Path) -> Server:
    if args.engine == "sglang":
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--base-gpu-id", str(gpu), "--mem-fraction-static", str(mem),
                "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--disable-cuda-graph", "--log-level", "warning"] + args.sglang_extra.split()
    else:
        argv = [sys.executable, "-m", "agentrl.engines.embedded", "--model-path", str(model), "--port", str(port),
                "--device", args.device, "--dtype", args.dtype, "--num-threads", "1"]
    log(f"start {name}: {' '.join(argv)}")
    return Server(name, argv, port, out / f"server_{name}.log")


async def wait_ready(server: Server, timeout_s: float) -> None:
    from agentrl.http import NO_RETRY
    from agentrl.rollout.client import EngineClient

    deadline = time.monotonic() + timeout_s
    async with EngineClient(server.url, retry=NO_RETRY) as c:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode} (see server_{server.name}.log)")
            if await c.health(timeout_s=5):
                try:
                    await asyncio.wait_for(c.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0}), 60)
                    server.ready_s = time.monotonic() - server.started
                    log(f"{server.name} ready after {server.ready_s:.1f}s")
                    return
                except Exception as exc:  # noqa: BLE001
                    log(f"{server.name}: healthy but /generate failed: {exc!r}")
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{server.name} not ready within {timeout_s}s")


# -- the trainer side --------------------------------------------------------------------------
class MegatronSide:
    """The Megatron trainer: its GPTModel holds the weights; sync sends its HF-named export."""
    kind = "megatron"

    def __init__(self, model: Path, device: str, dtype: str):
        from agentrl.config import AlgoConfig, TrainConfig
        from agentrl.trainers.megatron import MegatronTrainer

        self.t = MegatronTrainer(str(model), train=TrainConfig(lr=1e-6, global_batch_size=1, max_tokens_per_gpu=8192),
                                 algo=AlgoConfig(), temperature=1.0, device=device, dtype=dtype)

    def parameters(self):
        return self.t.model.parameters()

    def named_tensors(self, bucket_bytes: int):
        """What MegatronTrainer.named_tensors() streams, with the bucket size given here."""
        for bucket in self.t.hf_buckets(bucket_bytes=bucket_bytes):
            yield from bucket

    def compute_logprobs(self, samples):
        return self.t.compute_logprobs(samples)

    def save_hf(self, folder: Path):
        return self.t.save_hf(folder)


class HFSide:
    """Stand-in when megatron-core is missing or fails: the HF model, named_parameters() as export."""
    kind = "hf"

    def __init__(self, model: Path, device: str, dtype: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path, self.device = model, device
        self.m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
        self.tok = AutoTokenizer.from_pretrained(model)

    def parameters(self):
        return self.m.parameters()

    def named_tensors(self, bucket_bytes: int):
        for name, p in self.m.named_parameters():  # tied lm_head appears once, as model.embed_tokens
            yield name, p.detach()

    @torch.no_grad()
    def compute_logprobs(self, samples):
        out = []
        for s in samples:
            ids = torch.tensor([s.prompt_tokens + s.response_tokens], device=self.device)
            logits = self.m(input_ids=ids).logits[0].float()
            p = len(s.prompt_tokens)
            lp = torch.log_softmax(logits[p - 1:-1], -1)
            out.append(lp.gather(-1, ids[0, p:, None]).squeeze(-1).tolist())
        return out

    def save_hf(self, folder: Path):
        self.m.save_pretrained(folder)
        self.tok.save_pretrained(folder)
        return folder


_BASE: list[torch.Tensor] = []


@torch.no_grad()
def perturb(side, version: int, noise: float):
    """The trainer's weights for `version`: the initial ones + fresh N(0, noise) (not cumulative)."""
    params = list(side.parameters())
    if not _BASE:
        _BASE.extend(p.detach().clone() for p in params)
    g = torch.Generator(device=params[0].device).manual_seed(1000 + version)
    for p, base in zip(params, _BASE):
        p.copy_(base.float() + torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * noise)


def fused_like_sglang(named) -> dict[str, torch.Tensor]:
    """HF-named tensors -> SGLang's Qwen2 parameter names and layout (TP 1): q/k/v -> qkv_proj,
    gate/up -> gate_up_proj, the rest as is."""
    hf = dict(named)
    out = {}
    for name, t in hf.items():
        if ".q_proj." in name:
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [t, hf[name.replace(".q_proj.", ".k_proj.")], hf[name.replace(".q_proj.", ".v_proj.")]], 0)
        elif ".gate_proj." in name:
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [t, hf[name.replace(".gate_proj.", ".up_proj.")]], 0)
        elif not any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


# -- one check ---------------------------------------------------------------------------------
PROMPTS = [[(17 + 7919 * i) % 151000 + 256 for i in range(24)], [(101 + 104729 * i) % 151000 + 256 for i in range(40)]]


async def verify(args, client, side, version: int | None) -> dict:
    from agentrl.types import Sample

    samples, versions = [], []
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32, "ignore_eos": True}
    for prompt in PROMPTS:
        out = await client.generate(prompt, params)
        versions.append(out.weight_version)
        s = Sample(prompt_tokens=list(prompt))
        s.append_generated(out.output_ids, out.logprobs, 0)
        samples.append(s)
    ours = await asyncio.to_thread(side.compute_logprobs, samples)
    diffs = [abs(a - b) for s, row in zip(samples, ours) for a, b in zip(row, s.rollout_logprobs)]
    res = {"logprob_max_diff": max(diffs), "logprob_mean_diff": sum(diffs) / len(diffs), "tokens": len(diffs),
           "engine_weight_version": versions[0],
           "engine_logprob_mean": sum(x for s in samples for x in s.rollout_logprobs) / len(diffs)}
    if version is not None:
        res["version_ok"] = all(v == str(version) for v in versions)
    if args.engine == "sglang" and args.checksum:
        res["checksum"] = await checksum_check(client, side)
    return res


async def checksum_check(client, side) -> dict:
    try:
        from sglang.srt.managers.mm_utils import tensor_hash
    except Exception as exc:  # noqa: BLE001
        return {"error": f"sglang tensor_hash not importable: {exc!r}"}
    reply = await client.post("/weights_checker", {"action": "checksum"})
    try:
        theirs = reply["ranks"][0]["checksums"]
    except (KeyError, TypeError, IndexError):
        return {"error": f"unexpected /weights_checker reply: {str(reply)[:300]}"}

    def ours():
        fused = fused_like_sglang(side.named_tensors(256 * 2**20))
        return {n: f"{tensor_hash(t.contiguous()):016x}" for n, t in fused.items()}

    mine = await asyncio.to_thread(ours)
    common = sorted(set(theirs) & set(mine))
    bad = [n for n in common if theirs[n] != mine[n]]
    return {"engine_tensors": len(theirs), "trainer_tensors": len(mine), "compared": len(common),
            "identical": len(common) - len(bad), "differ": bad[:5],
            "engine_only": sorted(set(theirs) - set(mine))[:5], "trainer_only": sorted(set(mine) - set(theirs))[:5]}


# -- main ------------------------------------------------------------------------------------
async def run(args, out: Path, results: dict, save):
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import WeightUpdateGroup, sync_weights_from_disk, sync_weights_from_tensor

    dev = args.device
    tdev = "cuda:0" if dev == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    phases = args.phases.split(",")
    deadline = T0 + args.deadline_s

    t = time.monotonic()
    model = make_checkpoint(Path(args.model_dir), args.shape, dtype, tdev)
    results["checkpoint_s"] = time.monotonic() - t
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    results["checkpoint_gb"] = size / 1e9
    log(f"checkpoint {model}: {size / 1e9:.2f} GB in {results['checkpoint_s']:.1f}s")
    save()

    servers = {}
    if "colocated" in phases or "disk" in phases:
        servers["colo"] = start_server(args, "colo", 0, args.port, args.mem_colo, model, out)
    if "distributed" in phases:
        servers["dist"] = start_server(args, "dist", 1 if dev == "cuda" else 0, args.port + 1000, args.mem_dist,
                                       model, out)
    try:
        # the trainer loads while the engines start
        t = time.monotonic()
        side = None
        if args.trainer == "megatron":
            try:
                side = MegatronSide(model, dev, args.dtype)
            except Exception:  # noqa: BLE001
                results["megatron_error"] = traceback.format_exc()[-3000:]
                log("MEGATRON FAILED, falling back to the HF stand-in\n" + results["megatron_error"])
        if side is None:
            side = HFSide(model, tdev, args.dtype)
        results["trainer"] = side.kind
        results["trainer_build_s"] = time.monotonic() - t
        sync_device(dev)
        nbytes = sum(t_.numel() * t_.element_size() for _, t_ in side.named_tensors(256 * 2**20))
        results["sync_gb"] = nbytes / 1e9
        results["sync_tensors"] = sum(1 for _ in side.named_tensors(256 * 2**20))
        log(f"trainer {side.kind} built in {results['trainer_build_s']:.1f}s; sync payload {nbytes / 1e9:.3f} GB "
            f"in {results['sync_tensors']} HF tensors")
        # export alone, per bucket size (what each sync below spends before any engine sees a byte)
        results["export"] = []
        for mb in args.buckets_mb:
            sync_device(dev)
            t = time.perf_counter()
            n = sum(1 for _ in side.named_tensors(int(mb * 2**20)))
            sync_device(dev)
            results["export"].append({"bucket_mb": mb, "tensors": n, "s": time.perf_counter() - t})
        log("export", json.dumps(results["export"]))
        save()

        ready = await asyncio.gather(*[wait_ready(s, args.server_timeout_s) for s in servers.values()],
                                     return_exceptions=True)
        results["engine_ready_s"] = {k: s.ready_s for k, s in servers.items()}
        for (k, s), r in zip(servers.items(), ready):
            if isinstance(r, Exception):
                results.setdefault("errors", {})[f"start_{k}"] = repr(r)
                log(f"{k} failed to start: {r!r}")
        save()
        clients = {k: EngineClient(s.url, request_timeout_s=args.step_timeout_s)
                   for (k, s), r in zip(servers.items(), ready) if not isinstance(r, Exception)}
        version = 0

        async def step(name, coro):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: past the --deadline-s")
            return await asyncio.wait_for(coro, args.step_timeout_s)

        # (a) colocated: CUDA IPC handles (embedded engine: base64 torch.save) per bucket
        if "colocated" in phases and "colo" in clients:
            c = clients["colo"]
            res = results["colocated"] = {"runs": [], "checks": []}
            try:
                version += 1
                perturb(side, version, args.noise)
                res["before_sync"] = await step("check", verify(args, c, side, None))
                log("colocated, engine on the initial weights vs trainer's new ones:", json.dumps(res["before_sync"]))
                for mb in args.buckets_mb:
                    for r in range(args.repeats + 1):  # the first is a warm-up
                        if r:
                            version += 1
                            perturb(side, version, args.noise)
                        sync_device(dev)
                        o = await step("sync", sync_weights_from_tensor(
                            [c], side.named_tensors(int(mb * 2**20)), version=version, bucket_bytes=int(mb * 2**20)))
                        run_ = {"bucket_mb": mb, "warmup": r == 0, "version": version, **o,
                                "gb_per_s": nbytes / 1e9 / o["weight_sync_s"]}
                        res["runs"].append(run_)
                        log("colocated", json.dumps(run_))
                    chk = {"bucket_mb": mb, "version": version, **await step("check", verify(args, c, side, version))}
                    res["checks"].append(chk)
                    log("colocated check", json.dumps(chk))
                    save()
            except Exception:  # noqa: BLE001
                res["error"] = traceback.format_exc()[-3000:]
                log("COLOCATED FAILED\n" + res["error"])
            save()

        # (b) disaggregated: NCCL (gloo on CPU) broadcast from the trainer, rank 0
        if "distributed" in phases and "dist" in clients:
            c = clients["dist"]
            res = results["distributed"] = {"runs": [], "checks": []}
            group = WeightUpdateGroup([c], backend="nccl" if dev == "cuda" else "gloo", timeout_s=args.step_timeout_s)
            try:
                version += 1
                perturb(side, version, args.noise)
                res["before_sync"] = await step("check", verify(args, c, side, None))
                t = time.perf_counter()
                await step("init group", group.init(device=tdev))
                res["init_group_s"] = time.perf_counter() - t
                log(f"distributed: group ready in {res['init_group_s']:.2f}s")
                for mb in args.buckets_mb:
                    for r in range(args.repeats + 1):
                        if r:
                            version += 1
                            perturb(side, version, args.noise)
                        sync_device(dev)
                        o = await step("sync", group.sync(side.named_tensors(int(mb * 2**20)), version=version,
                                                          bucket_bytes=int(mb * 2**20)))
                        run_ = {"bucket_mb": mb, "warmup": r == 0, "version": version, **o,
                                "gb_per_s": nbytes / 1e9 / o["weight_sync_s"]}
                        res["runs"].append(run_)
                        log("distributed", json.dumps(run_))
                    chk = {"bucket_mb": mb, "version": version, **await step("check", verify(args, c, side, version))}
                    res["checks"].append(chk)
                    log("distributed check", json.dumps(chk))
                    save()
            except Exception:  # noqa: BLE001
                res["error"] = traceback.format_exc()[-3000:]
                log("DISTRIBUTED FAILED\n" + res["error"])
            finally:
                try:
                    await asyncio.wait_for(group.close(), 30)
                except Exception as exc:  # noqa: BLE001
                    res["close_error"] = repr(exc)
            save()

        # (c) disk: save_hf, then every engine loads it
        if "disk" in phases and clients:
            res = results["disk"] = {"runs": []}
            try:
                for r in range(args.disk_repeats):
                    version += 1
                    perturb(side, version, args.noise)
                    folder = Path(args.save_dir) / f"v{version}"
                    sync_device(dev)
                    t = time.perf_counter()
                    await step("save_hf", asyncio.to_thread(side.save_hf, folder))
                    save_s = time.perf_counter() - t
                    run_ = {"version": version, "save_hf_s": save_s}
                    for k, c in clients.items():
                        o = await step("load", sync_weights_from_disk([c], str(folder), version=version))
                        run_[f"load_{k}_s"] = o["weight_sync_s"]
                        run_[f"check_{k}"] = await step("check", verify(args, c, side, version))
                    res["runs"].append(run_)
                    log("disk", json.dumps(run_))
                    save()
            except Exception:  # noqa: BLE001
                res["error"] = traceback.format_exc()[-3000:]
                log("DISK FAILED\n" + res["error"])
            save()
        await asyncio.gather(*[c.close() for c in clients.values()])
    finally:
        for s in servers.values():
            s.stop()
        results["engine_exit_codes"] = {k: s.proc.returncode for k, s in servers.items()}


def summarize(results: dict) -> dict:
    """Median seconds and GB/s per path and bucket size (warm-ups left out)."""
    import statistics

    out = {}
    for path in ("colocated", "distributed"):
        runs = [r for r in results.get(path, {}).get("runs", []) if not r["warmup"]]
        for mb in sorted({r["bucket_mb"] for r in runs}):
            s = [r["weight_sync_s"] for r in runs if r["bucket_mb"] == mb]
            out[f"{path}_{mb:g}mb"] = {"median_s": statistics.median(s), "min_s": min(s), "n": len(s),
                                       "gb_per_s_median": results["sync_gb"] / statistics.median(s)}
    disk = results.get("disk", {}).get("runs", [])
    if disk:
        out["disk"] = {k: statistics.median(r[k] for r in disk) for k in disk[0] if k.endswith("_s")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--engine", choices=["sglang", "embedded"], default="sglang")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--trainer", choices=["megatron", "hf"], default="megatron",
                   help="megatron falls back to the HF stand-in if it cannot be built (recorded)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--model-dir", default="/tmp/ws-qwen2.5-1.5b")
    p.add_argument("--save-dir", default="/tmp/ws-save")
    p.add_argument("--phases", default="colocated,distributed,disk")
    p.add_argument("--buckets-mb", type=lambda s: [float(x) for x in s.split(",")], default=[64.0, 256.0, 1024.0])
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per bucket size (after one warm-up)")
    p.add_argument("--disk-repeats", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.01,
                   help="std of the noise on the initial weights before every sync (init std 0.02)")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--mem-colo", type=float, default=0.45)
    p.add_argument("--mem-dist", type=float, default=0.6)
    p.add_argument("--sglang-extra", default="", help="more SGLang server flags")
    p.add_argument("--no-checksum", dest="checksum", action="store_false")
    p.add_argument("--server-timeout-s", type=float, default=240)
    p.add_argument("--step-timeout-s", type=float, default=120)
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no step after this many seconds")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":  # megatron-core on CPU: the test-only shim
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainers"))
        import megatron_cpu_shim

        megatron_cpu_shim.apply()
    if args.device == "cuda":
        # as SGLang itself runs (unless told otherwise); NCCL reads it at this process's first communicator,
        # which the Megatron trainer makes when it is built. Mismatched, the NCCL broadcast fails (weight_sync.md).
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"argv": sys.argv[1:], "torch": torch.__version__, "shape": args.shape, "engine": args.engine,
               "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
               "env": {k: os.environ.get(k) for k in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE")}}
    for mod in ("sglang", "megatron.core", "transformers"):
        try:
            results[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as exc:  # noqa: BLE001
            results[mod] = f"not importable: {exc!r}"[:200]

    def save():
        results["elapsed_s"] = time.monotonic() - T0
        try:
            results["summary"] = summarize(results)
        except Exception as exc:  # noqa: BLE001
            results["summary"] = {"error": repr(exc)}
        tmp = out / "weight_sync.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(out / "weight_sync.json")

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run(args, out, results, save))
    except Exception:  # noqa: BLE001
        results.setdefault("errors", {})["run"] = traceback.format_exc()[-3000:]
        log("RUN FAILED\n" + results["errors"]["run"])
    save()
    log("SUMMARY", json.dumps(results["summary"], indent=1))
    log("DONE")
    # no waiting for worker threads: a broadcast stuck after a failed step must not hold the exit
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
