"""Vision-language RL (--multimodal-keys, agentrl/vision.py): a prompt row's images loaded as
slime loads them, the prompt ids from the model's processor, /generate's `image_data` served by
the embedded engine as strictly as SGLang takes it, and the trainer's logprobs of the same tokens
with the same images. The model: a tiny random Qwen2-VL built here (models.build_tiny_vlm)."""

import asyncio
import base64
import json

import pytest

import agentrl
from agentrl.data import read_rows
from agentrl.errors import DatasetError
from agentrl.models import is_vision_model, load_tokenizer
from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateResult
from agentrl.types import SampleStatus
from agentrl.vision import (load_processor, message_images, open_data_url, placeholder_runs,
                            tokens_per_image)
from vision_helpers import COLOURS, assert_learned_the_colours, colour_parity_task, png


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- data ------------------------------------------------------------------------------------------
def test_rows_images_take_their_placeholders_in_any_of_slimes_forms(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(png("red"))
    url = "data:image/png;base64," + base64.b64encode(png("blue")).decode()
    data = write_jsonl(tmp_path / "rows.jsonl", [
        {"problem": "Left <image> right <image>?", "answer": "x", "images": ["figs/a.png", url]},  # path (by the file), URL
        {"problem": "Text only", "answer": "y"},  # no images column: a text prompt, as in slime
        {"problem": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image> colour?"}],
         "answer": "z", "images": [{"path": str(tmp_path / "figs" / "a.png"), "bytes": None}]},  # HF dict by path
    ])
    tasks = read_rows(str(data), input_key="problem", label_key="answer", multimodal_keys={"image": "images"})
    first = tasks[0]["prompt"]
    assert [p["type"] for p in first[0]["content"]] == ["text", "image", "text", "image", "text"]
    assert [p.get("text") for p in first[0]["content"]] == ["Left ", None, " right ", None, "?"]
    red, blue = (open_data_url(u).getpixel((3, 3)) for u in message_images(first))
    assert red == COLOURS["red"] and blue == COLOURS["blue"]
    assert tasks[1]["prompt"] == "Text only"
    assert tasks[2]["prompt"][0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert len(message_images(tasks[2]["prompt"])) == 1

    # geo3k's form: parquet rows whose `images` hold HF datasets' {"bytes", "path"} dicts
    pq.write_table(pa.Table.from_pylist([{"problem": "<image>Which?", "answer": "red",
                                          "images": [{"bytes": png("red"), "path": None}]}]), tmp_path / "t.parquet")
    (task,) = read_rows(str(tmp_path / "t.parquet"), input_key="problem", label_key="answer",
                        multimodal_keys={"image": "images"})
    assert open_data_url(message_images(task["prompt"])[0]).getpixel((0, 0)) == COLOURS["red"]


@pytest.mark.parametrize("images, problem, error", [
    (["missing.png"], "<image>", r"rows.jsonl:1: images\[0\]: no such image file 'missing.png'"),
    (["https://example.com/a.png"], "<image>", r"rows.jsonl:1: images\[0\]: image URLs are not fetched"),
    (["data:image/png;base64,bm90IGFuIGltYWdl"], "<image>", r"rows.jsonl:1: images\[0\]: cannot read the image"),
    ([{"bytes": None, "path": None}], "<image>", r"rows.jsonl:1: images\[0\]: an image dict needs 'bytes' or 'path'"),
    ([7], "<image>", r"rows.jsonl:1: images\[0\]: an image must be a file path, .*got int"),
    ("a.png", "<image>", r"rows.jsonl:1: 'images' .* must be a list of images, got str"),
    (["ok.png"], "<image> and <image>", r"rows.jsonl:1: more '<image>' placeholders in the prompt than the 1 images"),
    (["ok.png", "ok.png"], "<image>", r"rows.jsonl:1: 'images' has 2 images but the prompt has 1 '<image>'"),
])
def test_bad_media_names_file_row_and_field(tmp_path, images, problem, error):
    (tmp_path / "ok.png").write_bytes(png("red"))
    (tmp_path / "junk.png").write_bytes(b"not a png")
    data = write_jsonl(tmp_path / "rows.jsonl", [{"problem": problem, "answer": "a", "images": images}])
    with pytest.raises(DatasetError, match=error):
        read_rows(str(data), input_key="problem", label_key="answer", multimodal_keys={"image": "images"})


def test_the_flag_is_checked_when_the_config_is_read(tmp_path):
    from agentrl.config import parse_config
    from agentrl.errors import ConfigError

    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "<image>", "label": "a", "images": []}])
    cfg, _ = parse_config(["--prompt-data", str(data), "--multimodal-keys", '{"image": "images"}'])
    assert cfg.data.multimodal_keys == {"image": "images"}
    cfg, _ = parse_config(["--prompt-data", str(data), "--multimodal-keys", '{"image": "images"}',
                           "--trainer", "megatron"])
    assert cfg.train.trainer == "megatron"  # Qwen2-VL / Qwen2.5-VL (tests/trainers/test_megatron_vlm.py)
    for extra, error in [(["--multimodal-keys", '{"video": "clips"}'], "images only .*'video'"),
                         (["--no-apply-chat-template"], "chat template"),
                         (["--advantage-estimator", "ppo"], "critic reads text only"),
                         (["--custom-generate-function-path", "json.loads"], "does not carry the images")]:
        with pytest.raises(ConfigError, match=error):
            parse_config(["--prompt-data", str(data), "--multimodal-keys", '{"image": "images"}', *extra])


# -- prompt ----------------------------------------------------------------------------------------
def test_the_tiny_vlm_config_has_what_sglang_reads(vlm):
    """SGLang 0.5.15's Qwen2VisionTransformer reads these of vision_config (as a published Qwen2-VL
    config.json holds them); `in_chans` is the one transformers 5 no longer writes (the GPU scenario
    vlm_sglang failed on it, 2026-12-03)."""
    from transformers import AutoConfig

    vision = AutoConfig.from_pretrained(str(vlm)).vision_config
    for key in ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_chans", "hidden_size", "embed_dim",
                "depth", "num_heads", "mlp_ratio"):
        assert getattr(vision, key, None) is not None, key
    assert vision.in_chans == vision.in_channels == 3


def test_prompt_ids_are_the_processors_with_each_image_expanded(vlm, processor):
    tokenizer = load_tokenizer(vlm)
    renderer = Renderer(tokenizer, processor=processor)
    url = "data:image/png;base64," + base64.b64encode(png("red", (16, 24))).decode()
    messages = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Which?"}]}]
    text, ids = renderer.prompt(messages, None)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Which?<|im_end|>\n<|im_start|>assistant\n"
    want = processor(text=[text], images=[open_data_url(url)], add_special_tokens=False)["input_ids"][0]
    assert ids == list(want)
    grid = processor.image_processor(images=[open_data_url(url)], return_tensors="pt")["image_grid_thw"]
    (start, n), = placeholder_runs(ids, processor.image_token_id)
    assert n == tokens_per_image(processor, grid)[0] == 6  # 16x24 pixels: 4x6 patches, merged 2x2
    # the rest is the tokenizer's text, token for token
    assert ids[:start] + ids[start + n:] == renderer.encode(text.replace("<|image_pad|>", ""))
    assert renderer.images(messages) == [url] and Renderer(tokenizer).images(messages) == []


def test_the_sglang_wrapper_sends_one_image_token_per_image(vlm, processor, tmp_path):
    """SGLang 0.5.15 takes a pre-tokenized prompt with one image token per image and expands it
    (an expanded run: HTTP 500 on an H200, 2026-12-03); agentrl's SGLang wrapper turns the agent
    loop's expanded ids into that form. SGLang's expansion of what it gets (each image token by its
    image's count, SGLANG_MM_AVOID_RETOKENIZE) is the caller's prompt again, token for token."""
    from agentrl.engines.sglang_server import ImagePlaceholders, image_token_id

    assert image_token_id(["--port", "1", "--model-path", str(vlm)]) == processor.image_token_id
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "image_token_id": 5}))
    assert image_token_id(["--model-path", str(tmp_path)]) is None and image_token_id([]) is None
    image = processor.image_token_id
    urls = ["data:image/png;base64," + base64.b64encode(png(c, size)).decode()
            for c, size in (("red", (16, 24)), ("blue", (16, 16)))]
    text = "<|vision_start|><|image_pad|><|vision_end|>a<|vision_start|><|image_pad|><|vision_end|>b"
    ids = list(processor(text=[text], images=[open_data_url(u) for u in urls])["input_ids"][0])
    assert [n for _, n in placeholder_runs(ids, image)] == [6, 4]
    seen = []

    async def sglang(scope, receive, send):
        message = await receive()
        seen.append((dict(scope["headers"]), json.loads(message["body"])))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def post(path, request):
        body = json.dumps(request).encode()

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"%d" % len(body))]}
        await ImagePlaceholders(sglang, image_token_id=image)(scope, receive, send)

    asyncio.run(post("/generate", {"input_ids": ids, "image_data": urls, "rid": "r"}))
    headers, sent = seen[-1]
    assert [n for _, n in placeholder_runs(sent["input_ids"], image)] == [1, 1] and sent["rid"] == "r"
    assert int(headers[b"content-length"]) == len(json.dumps(sent).encode())
    counts = iter(tokens_per_image(processor, processor.image_processor(
        images=[open_data_url(u) for u in urls], return_tensors="pt")["image_grid_thw"]))
    assert [x for t in sent["input_ids"] for x in ([t] * next(counts) if t == image else [t])] == ids
    for request in ({"input_ids": ids}, {"text": text, "image_data": urls}):  # no images, or text: as sent
        asyncio.run(post("/generate", request))
        assert seen[-1][1] == request


def test_a_vlm_engine_takes_weight_updates_only_with_sglangs_image_cache_off(vlm, monkeypatch):
    """SGLang caches a VLM's image embeddings by image (SGLANG_VLM_CACHE_SIZE_MB, 100 by default) and
    no weight update or flush clears them: after a sync it served the old vision tower's features
    (the weight check failed on an H200, 2026-12-03). agentrl starts every engine with the cache off;
    the embedded engine refuses an update with it on, where SGLang would drift silently."""
    from aiohttp.test_utils import TestClient, TestServer

    from agentrl.engines.embedded import EmbeddedEngine, encode_named_tensors
    from agentrl.engines.launch import ENGINE_ENV

    assert ENGINE_ENV["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    engine = EmbeddedEngine(str(vlm), prefix_cache_tokens=0)
    name, weight = next((n, p) for n, p in engine.model.named_parameters() if "visual" in n)

    async def update(version):
        async with TestClient(TestServer(engine.app())) as client:
            r = await client.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [encode_named_tensors([(name, weight.detach().clone())])],
                "weight_version": version})
            return r.status, await r.json()

    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB", raising=False)
    status, reply = asyncio.run(update("1"))
    assert status == 400 and not reply["success"] and "SGLANG_VLM_CACHE_SIZE_MB=100 (the default)" in reply["message"]
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "0")
    assert asyncio.run(update("2")) == (200, {"success": True, "message": "Succeeded to update 1 tensors."})
    assert engine.weight_version == "2"


# -- agent loop ------------------------------------------------------------------------------------
class ImageEnv(agentrl.Env):
    """Two turns on an image prompt; each reply earns 0.5."""

    max_turns = 2

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return options["prompt"], {}

    def step(self, action):
        self.turn += 1
        return "go on", 0.5, self.turn == 2, False, {}


class ScriptedClient:
    """Replies with scripted token ids (then EOS), recording each request's ids and images."""

    def __init__(self, eos, replies):
        self.eos, self.replies, self.calls = eos, list(replies), []

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None,
                       image_data=None):
        self.calls.append((list(input_ids), image_data))
        ids = self.replies.pop(0) + [self.eos]
        return GenerateResult(ids, [-0.5] * len(ids), "stop", len(input_ids), 0, "0")


def test_an_engine_that_expands_the_images_otherwise_fails_the_trajectory_saying_so(vlm, processor):
    """SGLang expands image placeholders by its own processor rules (slime sends it text for that
    reason): a count other than the one sent means the trajectory's tokens are not what the engine
    saw, an engine failure that names both counts."""
    tokenizer = load_tokenizer(vlm)

    class Expands(ScriptedClient):
        async def generate(self, input_ids, sampling_params, **kw):
            result = await super().generate(input_ids, sampling_params, **kw)
            result.prompt_tokens += 12
            return result

    url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
    prompt = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Colour?"}]}]
    sample = asyncio.run(run_trajectory(
        ImageEnv(), {"prompt": prompt}, renderer=Renderer(tokenizer, processor=processor),
        client=Expands(tokenizer.eos_token_id, [[5]]), trajectory_id="t", group_id=0, seed=0,
        settings=LoopSettings(max_response_len=64, max_turns=2, sampling_params={"temperature": 1.0})))
    assert sample.status == SampleStatus.FAILED
    assert "read 37 prompt tokens where 25 were sent with the images" in sample.metadata["error"]


def test_images_in_a_later_observation_fail_the_trajectory_saying_so(vlm, processor):
    tokenizer = load_tokenizer(vlm)
    url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
    prompt = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Colour?"}]}]

    class ShowsMore(ImageEnv):
        def step(self, action):
            return [{"role": "user", "content": [{"type": "image", "image": url}]}], 0.0, False, False, {}

    sample = asyncio.run(run_trajectory(
        ShowsMore(), {"prompt": prompt}, renderer=Renderer(tokenizer, processor=processor),
        client=ScriptedClient(tokenizer.eos_token_id, [[5], [5]]), trajectory_id="t", group_id=0, seed=0,
        settings=LoopSettings(max_response_len=64, max_turns=2, sampling_params={"temperature": 1.0})))
    assert sample.status == SampleStatus.FAILED and "observation holds images" in sample.metadata["error"]


@pytest.mark.parametrize("written", [False, True])
def test_every_turn_sends_the_images_and_a_placeholder_the_model_writes_is_its_fault(vlm, processor, written):
    """Each request of a trajectory carries its prompt's images beside the ids that hold their
    placeholders; a reply holding a media token (a placeholder with no image) ends the trajectory
    scored 0 as the agent's fault, before any request could carry it."""
    tokenizer = load_tokenizer(vlm)
    url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
    prompt = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Colour?"}]}]
    word = tokenizer.encode("red", add_special_tokens=False)
    client = ScriptedClient(tokenizer.eos_token_id, [word + ([processor.image_token_id] if written else []), word])
    sample = asyncio.run(run_trajectory(
        ImageEnv(), {"prompt": prompt}, renderer=Renderer(tokenizer, processor=processor), client=client,
        settings=LoopSettings(max_response_len=64, max_turns=2, sampling_params={"temperature": 1.0}), trajectory_id="t",
        group_id=0, seed=0))
    assert sample.images == [url] and sample.status == SampleStatus.COMPLETED
    assert all(images == [url] and ids.count(processor.image_token_id) == 4 for ids, images in client.calls)
    if written:
        assert len(client.calls) == 1 and sample.reward == 0.0
        assert "media placeholder tokens" in sample.metadata["agent_fault"]
    else:
        assert len(client.calls) == 2 and sample.reward == 1.0 and "agent_fault" not in sample.metadata


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_agentrl_train_learns_what_only_the_image_tells(vlm, tmp_path):
    """`agentrl train` with geo3k's flags on a tiny random Qwen2-VL, the colour-parity task
    (vision_helpers.colour_parity_task: a policy blind to the image scores 0.5 whatever it does); the
    run climbs well above that. Trajectories carry their image; the weight check's probe (with its
    images) finds the engine's and the trainer's logprobs equal. (The Megatron trainer's run:
    tests/trainers/test_megatron_vlm.py.)"""
    import subprocess

    from spine_helpers import agentrl_cli, run_env

    env = run_env()
    env["PYTHONPATH"] = ":".join([str(tmp_path), *[p for p in [env.get("PYTHONPATH")] if p]])
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", *colour_parity_task(tmp_path, vlm, out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_learned_the_colours(out)
    (first,) = [json.loads(line) for line in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()][:1]
    (image,) = first["images"]
    assert open_data_url(image).getpixel((0, 0)) == COLOURS[first["metadata"]["label"]]
    assert first["messages"][0]["content"][0] == {"type": "image", "image": "images[0]"}  # saved once
    assert first["prompt_tokens"].count(load_processor(vlm).image_token_id) == 4


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_the_forward_with_images_is_the_models_own(processor, family):
    """vision.forward_inputs (the features put at the placeholders, the multimodal rotary positions:
    what the engine's prefill and the trainer use, so that image tokens the model writes stay text)
    gives the logits the HF model's own forward gives with pixel_values, for both families."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    from agentrl.vision import forward_inputs

    urls = ["data:image/png;base64," + base64.b64encode(png(c, size)).decode()
            for c, size in [("red", (16, 24)), ("blue", (24, 16))]]
    text = "<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>a" * 2 + "<|im_end|>\n"
    out = processor(text=[text], images=[open_data_url(u) for u in urls], add_special_tokens=False, return_tensors="pt")
    tok = processor.tokenizer
    text_config = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
               vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
               vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    vision = dict(num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
            text_config=text_config, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, **vision),
            **ids))
    else:
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config, vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                                                        window_size=8, fullatt_block_indexes=[1], **vision), **ids))
    input_ids = out["input_ids"]
    with torch.no_grad():
        own = model.eval()(input_ids=input_ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                           mm_token_type_ids=out["mm_token_type_ids"]).logits
        kwargs, _ = forward_inputs(model, input_ids, torch.ones_like(input_ids), out["pixel_values"],
                                   out["image_grid_thw"], input_ids == processor.image_token_id)
        assert torch.allclose(model(**kwargs).logits, own, atol=1e-5)


def test_a_family_whose_forward_agentrl_does_not_reproduce_is_refused(vlm, tmp_path):
    import shutil

    from agentrl.errors import ModelLoadError

    other = tmp_path / "qwen3-vl"
    shutil.copytree(vlm, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl"}))
    with pytest.raises(ModelLoadError, match="model_type 'qwen3_vl': agentrl trains the vision-language families "
                                             "qwen2_vl, qwen2_5_vl"):
        load_processor(other)
    assert is_vision_model(vlm) and not is_vision_model(other)  # loaded as its text model, as before
