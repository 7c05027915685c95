"""The embedded engine with a vision-language model: /generate's `image_data` (SGLang's field)
taken as strictly as SGLang takes it, and the trainer's logprobs of the engine's tokens under the
same images (a tiny random Qwen2-VL, tests/conftest.py's tiny_vlm)."""

import asyncio
import base64

import pytest
import torch
from safetensors import safe_open

from agentrl.models import load_tokenizer
from agentrl.rollout.agent_loop import Renderer
from agentrl.types import Sample
from agentrl.vision import load_processor, placeholder_runs
from vision_helpers import png


def _prompt(renderer, colour):
    url = "data:image/png;base64," + base64.b64encode(png(colour)).decode()
    messages = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Colour?"}]}]
    return renderer.prompt(messages, None)[1], [url]


def test_image_data_is_sglangs_field_and_the_engine_is_as_strict(vlm, processor, tiny_model):
    """What the client sends fits SGLang's GenerateReqInput (input_ids + image_data); the embedded
    engine generates with the images, takes slime's form too (text + image_data, each placeholder
    expanded by the engine), and refuses what SGLang cannot serve either: more or fewer
    images than placeholder runs, a run of the wrong length, images for a text model, image tokens
    without images, a URL it would have to fetch."""
    from aiohttp.test_utils import TestServer

    from agentrl.engines.embedded import EmbeddedEngine
    from contract_helpers import CONTRACT, RecordingClient, check_reply, check_request

    torch.set_num_threads(1)
    fields = CONTRACT["requests"]["/generate"]["fields"]
    assert "image_data" in fields and "input_ids" in fields
    renderer = Renderer(load_tokenizer(vlm), processor=processor)
    ids, images = _prompt(renderer, "red")
    start, n = placeholder_runs(ids, processor.image_token_id)[0]
    engine, text_engine = EmbeddedEngine(str(vlm)), EmbeddedEngine(str(tiny_model))

    async def go():
        servers = [TestServer(e.app()) for e in (engine, text_engine)]
        for s in servers:
            await s.start_server()
        try:
            c = RecordingClient(str(servers[0].make_url("")).rstrip("/"))
            result = await c.generate(ids, {"max_new_tokens": 4, "temperature": 1.0}, image_data=images)
            # slime's first multimodal turn: text (one placeholder per image) + image_data, expanded by the engine
            async with c.session.post(c.base_url + "/generate", json={
                    "text": renderer.tokenizer.decode(ids[:start + 1] + ids[start + n:]), "image_data": images,
                    "sampling_params": {"max_new_tokens": 1}}) as r:
                from_text = (r.status, await r.json())
            bad = []
            for body in [{"input_ids": ids, "image_data": images * 2},  # two images, one placeholder
                         {"input_ids": ids + ids, "image_data": images},  # two placeholders, one image
                         {"input_ids": ids[:start + 1] + ids[start + n:], "image_data": images},  # unexpanded
                         {"input_ids": ids},  # image tokens, no image
                         {"input_ids": ids, "image_data": ["https://example.com/a.png"]},
                         {"input_ids": ids, "image_data": images, "logprob_start_len": 0}]:
                async with c.session.post(c.base_url + "/generate", json=body) as r:
                    bad.append((r.status, await r.text()))
            url = str(servers[1].make_url("")).rstrip("/")
            async with c.session.post(url + "/generate", json={"input_ids": [5, 6], "image_data": images}) as r:
                bad.append((r.status, await r.text()))
            await c.close()
            return result, c.calls, bad, from_text
        finally:
            for s in servers:
                await s.close()

    result, calls, bad, from_text = asyncio.run(go())
    assert from_text[0] == 200 and from_text[1]["meta_info"]["prompt_tokens"] == len(ids)
    assert 0 < len(result.output_ids) <= 4 and all(lp <= 0 for lp in result.logprobs)
    for path, payload, status, ctype, body in calls:
        check_request(path, payload)
        check_reply(path, status, ctype, body)
    assert calls[0][1]["image_data"] == images and calls[0][1]["input_ids"] == ids
    assert [s for s, _ in bad] == [400] * 7, bad
    for (_, message), words in zip(bad, ["1 image placeholders and image_data 2", "2 image placeholders and "
                                         "image_data 1", "has 1 image tokens, the image makes 4", "no image_data",
                                         "base64 data URLs", "logprob_start_len with image_data",
                                         "not a vision-language model"]):
        assert words in message, message


def test_engine_and_trainer_logprobs_agree_on_an_image_prompt(vlm, processor, tmp_path, monkeypatch):
    """A probe: the tokens the engine sampled for an image prompt (two images in a batch, beside a
    text-only prompt) have the same logprobs under the trainer's forward with the same images; and
    a weight sync carries every weight, the vision tower's too, under names the engine loads; a
    saved checkpoint keeps the processor."""
    from aiohttp.test_utils import TestServer

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.rollout.client import EngineClient
    from agentrl.trainers.torch_trainer import TorchTrainer
    from agentrl.weight_transfer import sync_weights_from_tensor

    torch.set_num_threads(1)
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "0")  # as agentrl starts engines (ENGINE_ENV)
    renderer = Renderer(load_tokenizer(vlm), processor=processor)
    engine = EmbeddedEngine(str(vlm))
    trainer = TorchTrainer(str(vlm), train=TrainConfig(lr=0.05), algo=AlgoConfig(), temperature=1.0)
    with torch.no_grad():  # the trainer's weights move away from the engine's, vision tower included
        for name, p in trainer.model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # what a sync sends: every weight under its checkpoint's name (SGLang's loader reads those)
    sent = [n for n, _ in trainer.named_tensors()]
    assert sorted(sent) == sorted(safe_open(str(vlm / "model.safetensors"), "pt").keys())
    assert any(n.startswith("visual.") for n in sent)

    async def go():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            c = EngineClient(str(server.make_url("")).rstrip("/"))
            await sync_weights_from_tensor([c], list(trainer.named_tensors()), version=1, bucket_bytes=1 << 16)
            prompts = [_prompt(renderer, "red"), _prompt(renderer, "blue"), (renderer.encode("plain text"), [])]
            results = await asyncio.gather(*[c.generate(ids, {"max_new_tokens": 6, "temperature": 1.0,
                                                              "ignore_eos": True}, image_data=imgs)
                                             for ids, imgs in prompts])
            await c.close()
            return prompts, results
        finally:
            await server.close()

    prompts, results = asyncio.run(go())
    for (_, p), (_, e) in zip(trainer.model.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, e)
    samples = []
    for (ids, imgs), r in zip(prompts, results):
        s = Sample(prompt_tokens=ids, images=imgs)
        s.append_generated(r.output_ids, r.logprobs, 1)
        samples.append(s)
    for s, ours in zip(samples, trainer.compute_logprobs(samples)):
        assert max(abs(a - b) for a, b in zip(ours, s.rollout_logprobs)) < 2e-4, (ours, s.rollout_logprobs)
    # the images matter: the same tokens under the other image score differently
    swapped = [Sample(prompt_tokens=samples[0].prompt_tokens, images=samples[1].images)]
    swapped[0].append_generated(samples[0].response_tokens, samples[0].rollout_logprobs, 1)
    assert trainer.compute_logprobs(swapped)[0] != pytest.approx(samples[0].rollout_logprobs, abs=1e-4)
    # a checkpoint the trainer saves is a VLM checkpoint again: the engines and a resumed run load its processor
    saved = trainer.save_hf(tmp_path / "saved")
    assert load_processor(saved).image_processor.merge_size == processor.image_processor.merge_size
