"""search-r1: the retrieval backends, the MCP search server over its transports, the env driven
by hand-written turns, and one training iteration via the CLI."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest
from aiohttp import web

import agentrl
from agentrl.data import read_rows
from agentrl.envs.search_r1 import (DATA_DIR, INVALID, SearchError, SearchR1Env, exact_match, f1_score,
                                    gold_answers, normalize_answer, parse_action)
from agentrl.envs.search_r1.make_data import build
from agentrl.tools.retrieval import BM25Retriever, Passage, RemoteRetriever, RetrievalError, format_passages

from envtest_helpers import assert_iteration_ok, ROOT, train_one_iteration
from waiting import accepts_connections, wait_until

# Search-R1's instruction as its own code writes it (its typo included), before "Question: ...\n"
SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. ")
TASK = {"prompt": "Who founded Vrokath Works?", "label": ["Lomaerk Deloth", "Deloth"], "metadata": {}}


# -- scoring ---------------------------------------------------------------------------------------
def test_normalization_em_f1():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert exact_match("the beekeeper.", ["a beekeeper"]) == 1.0
    assert exact_match("beekeepers", ["beekeeper"]) == 0.0
    assert exact_match("Deloth", ["Lomaerk Deloth", "Deloth"]) == 1.0  # any gold answer
    assert f1_score("Lomaerk", ["Lomaerk Deloth"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["Lomaerk Deloth"]) == 0.0
    assert gold_answers({"target": ["a", "b"]}) == ["a", "b"]
    assert gold_answers("Paris") == ["Paris"] and gold_answers('["x", "y"]') == ["x", "y"]
    assert parse_action("<think>hm</think> <search> q1 </search> <answer>x</answer>") == ("search", "q1")
    assert parse_action("<answer>\nParis\n</answer>") == ("answer", "Paris")
    assert parse_action("<search> unclosed") == (None, "")



def test_rendering_is_search_r1s_byte_for_byte():
    """Strings written out by hand from Search-R1 at a14dc3a (PeterGriffinJin/Search-R1):
    scripts/data_process/nq_search.py:26-39 (make_prefix, base template; the trailing `\\`
    joins lines without a newline; "as many times as your want" is Search-R1's own typo) and
    :61-63 (question stripped, '?' appended); search_r1/llm_agent/generation.py:460-469
    (_passages2string: title = first line of contents, as stored, quotes included)."""
    expected_prompt = SEARCH_R1_INSTRUCTION + "Question: who founded vrokath works?\n"
    obs, _ = SearchR1Env().reset(options={"prompt": "  who founded vrokath works ", "label": ["x"]})
    assert obs == expected_prompt
    passages = [Passage("0", '"Quenmoor"\nQuenmoor is a city.', 1.0), Passage("1", "Plain\nline one\nline two")]
    assert format_passages(passages) == ('Doc 1(Title: "Quenmoor") Quenmoor is a city.\n'
                                         "Doc 2(Title: Plain) line one\nline two\n")


# -- the env, by hand --------------------------------------------------------------------------------
def test_search_then_correct_answer(run_async):
    async def episode():
        env = agentrl.make("search-r1")
        try:
            obs, info = await env.areset(seed=0, options=TASK)
            assert "<search> query </search>" in obs and obs.endswith("Question: Who founded Vrokath Works?\n")
            obs, reward, terminated, truncated, info = await env.astep(
                "<think>I do not know this company.</think>\n<search> Vrokath Works founder </search>")
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert len(obs) == 1 and obs[0]["role"] == "user"
            text = obs[0]["content"]
            assert text.startswith('<information>Doc 1(Title: "Vrokath Works")') and text.endswith("</information>")
            assert "Vrokath Works was founded by Lomaerk Deloth." in text
            assert text.count("Doc ") == 3  # topk=3
            assert info == {"query": "Vrokath Works founder", "searches": 1, "metrics": {"searches": 1}}
            obs, reward, terminated, truncated, info = await env.astep(
                "<think>The passage says it.</think> <answer> Lomaerk Deloth </answer>")
            assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
            assert info["em"] == 1.0 and info["searches"] == 1
        finally:
            await env.aclose()

    run_async(episode())


def test_wrong_answer_and_f1(run_async):
    env = SearchR1Env()
    env.reset(options=TASK)
    obs, reward, terminated, _, info = env.step("<answer> Lomaerk </answer>")
    assert (obs, reward, terminated) == ([], 0.0, True) and info["f1"] == pytest.approx(2 / 3)
    f1_env = SearchR1Env(reward="f1")
    f1_env.reset(options=TASK)
    assert f1_env.step("<answer> Lomaerk </answer>")[1] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        SearchR1Env(reward="accuracy")


def test_malformed_actions_get_the_invalid_message():
    env = SearchR1Env(topk=1)
    env.reset(options=TASK)
    for bad in ("I think it is Deloth.", "<search> Vrokath Works", "<search>   </search>", "<answer>Deloth"):
        obs, reward, terminated, truncated, info = env.step(bad)
        assert obs == [{"role": "user", "content": INVALID}]
        assert (reward, terminated, truncated) == (0.0, False, False) and info["invalid"]
    obs, *_ = env.step("<search>Vrokath Works founded</search>")  # sync step, topk=1
    assert obs[0]["content"].count("Doc ") == 1


def test_nq_shaped_data_and_formatted_prompts(tmp_path):
    nq = tmp_path / "nq.jsonl"
    nq.write_text(json.dumps({"id": "q1", "question": "who founded vrokath works",
                              "golden_answers": ["Lomaerk Deloth"]}) + "\n")
    (task,) = read_rows(str(nq), input_key="question", label_key="golden_answers")
    env = SearchR1Env()
    obs, _ = env.reset(options=task)
    assert obs.endswith("Question: who founded vrokath works?\n")  # Search-R1 adds the "?"
    assert env.step("<answer>lomaerk deloth</answer>")[1] == 1.0
    messages = [{"role": "user", "content": "Q? Use <search> and <answer>."}]
    assert env.reset(options={"prompt": messages, "label": {"target": ["x"]}})[0] == messages
    with pytest.raises(ValueError):
        env.reset(options={"prompt": "q", "label": None})


def test_builtin_dataset_and_generator_is_deterministic():
    corpus, questions = build()
    assert len(corpus) == 300 and len(questions) == 200
    on_disk = [json.loads(line) for line in (DATA_DIR / "corpus.jsonl").read_text().splitlines()]
    assert on_disk == corpus, "envs/search_r1/data/ is stale: rerun python -m agentrl.envs.search_r1.make_data"
    train = [json.loads(line) for line in (DATA_DIR / "train.jsonl").read_text().splitlines()]
    assert train == questions[:180]
    a = [t for t, _ in zip(SearchR1Env.dataset(seed=5), range(200))]
    assert a == [t for t, _ in zip(SearchR1Env.dataset(seed=5), range(200))]
    assert {t["metadata"]["id"] for t in a[:180]} == {q["id"] for q in train}  # an epoch is a permutation
    test_ids = {q["id"] for q in questions[180:]}
    assert {t["metadata"]["id"] for t, _ in zip(SearchR1Env.dataset(split="test"), range(20))} == test_ids


def test_answers_are_retrievable():
    """The questions need the corpus: for most one-hop questions BM25's top 3 holds the answer."""
    retriever = BM25Retriever(DATA_DIR / "corpus.jsonl")
    questions = [json.loads(line) for line in (DATA_DIR / "train.jsonl").read_text().splitlines()]
    one_hop = [q for q in questions if q["hops"] == 1]
    results = retriever.search_sync([q["question"] for q in one_hop], 3)
    found = sum(any(normalize_answer(a) in normalize_answer(p.contents) for a in q["golden_answers"] for p in hits)
                for q, hits in zip(one_hop, results))
    assert found / len(one_hop) > 0.9


# -- retrieval backends ----------------------------------------------------------------------------
def test_bm25_index_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"T{i}"\n{text}'}) + "\n" for i, text in
                              enumerate(["red apples grow on trees", "the blue whale is large", "apples and pears"])))
    first = BM25Retriever(corpus)
    assert (first.index_dir / "params.index.json").exists() and str(first.index_dir).startswith(str(tmp_path))
    second = BM25Retriever(corpus)  # loads the cached index
    hits = second.search_sync(["apples", "whale", "zebra"], topk=5)
    assert [p.id for p in hits[0]] and set(p.id for p in hits[0]) == {"d0", "d2"}
    assert [p.id for p in hits[1]] == ["d1"] and hits[2] == []
    assert format_passages(hits[1]) == 'Doc 1(Title: "T1") the blue whale is large\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(RetrievalError, match="contents"):
        BM25Retriever(bad)


async def _retrieval_service(fail: bool = False, status: int = 500):
    """A stand-in for Search-R1's retrieval server: POST /retrieve (with `fail`, answers `status`)."""
    seen = []

    async def retrieve(request):
        body = await request.json()
        seen.append(body)
        if fail:
            return web.Response(status=status, text="index not loaded")
        result = [[{"document": {"id": f"{q}-{i}", "contents": f'"Title {i}"\nAbout {q}: passage {i}.'},
                    "score": 10.0 - i} for i in range(body["topk"])] for q in body["queries"]]
        return web.json_response({"result": result})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/retrieve", seen


def test_remote_retriever_and_env_over_it(run_async):
    async def main():
        runner, url, seen = await _retrieval_service()
        try:
            hits = await RemoteRetriever(url).search(["alpha", "beta"], topk=2)
            assert seen[0] == {"queries": ["alpha", "beta"], "topk": 2, "return_scores": True}
            assert hits[1] == [Passage("beta-0", '"Title 0"\nAbout beta: passage 0.', 10.0),
                               Passage("beta-1", '"Title 1"\nAbout beta: passage 1.', 9.0)]
            env = SearchR1Env(retriever_url=url, topk=2)
            await env.areset(options=TASK)
            obs, *_ = await env.astep("<search>gamma</search>")
            await env.aclose()
            assert obs[0]["content"] == ('<information>Doc 1(Title: "Title 0") About gamma: passage 0.\n'
                                         'Doc 2(Title: "Title 1") About gamma: passage 1.</information>')
            assert seen[-1]["queries"] == ["gamma"] and seen[-1]["topk"] == 2
        finally:
            await runner.cleanup()

    run_async(main())


def test_retrieval_outage_fails_the_trajectory_not_the_answer(run_async):
    async def main():
        runner, url, seen = await _retrieval_service(fail=True)
        try:
            with pytest.raises(RetrievalError, match="HTTP 500"):
                await RemoteRetriever(url, retries=1).search(["q"])
            assert len(seen) == 2  # retried once
            env = SearchR1Env(retriever_url=url)
            await env.areset(options=TASK)
            with pytest.raises(SearchError, match="HTTP 500"):
                await env.astep("<search>q</search>")
            await env.aclose()
        finally:
            await runner.cleanup()
        with pytest.raises(RetrievalError, match="failed"):  # nobody listening
            await RemoteRetriever(url, retries=0, timeout_s=2).search(["q"])

    run_async(main())


def test_retrieval_5xx_is_retried_with_back_off_and_4xx_is_not(run_async):
    async def main():
        runner, url, seen = await _retrieval_service(fail=True)
        start = time.monotonic()
        try:
            with pytest.raises(RetrievalError, match=r"failed: .*HTTP 500: index not loaded"):
                await RemoteRetriever(url, retries=2).search(["q"])
            # waits of 0.2 s, then 0.4 s, each shortened by up to the retry policy's jitter (a quarter)
            assert len(seen) == 3 and time.monotonic() - start >= (0.2 + 0.4) * 0.75
        finally:
            await runner.cleanup()
        runner, url, seen = await _retrieval_service(fail=True, status=400)
        try:
            with pytest.raises(RetrievalError, match=r"retrieval service .* failed: .*HTTP 400: index not loaded"):
                await RemoteRetriever(url, retries=2).search(["q"])
            assert len(seen) == 1
        finally:
            await runner.cleanup()

    run_async(main())


# -- the MCP search server over stdio and streamable HTTP --------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_search_server_stdio_and_http(run_async):
    async def episode(server: str):
        env = SearchR1Env(search_server=server, topk=2)
        await env.areset(options=TASK)
        try:
            obs, *_ = await env.astep("<search>Vrokath Works founder</search>")
            obs2, *_ = await env.astep("<search>Lomaerk Deloth born</search>")  # the same connection
        finally:
            await env.aclose()
        return obs[0]["content"], obs2[0]["content"]

    first, second = run_async(episode("stdio"))
    assert "founded by Lomaerk Deloth" in first and first.count("Doc ") == 2 and "Lomaerk Deloth" in second

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.tools.search_server", "--corpus",
                             str(DATA_DIR / "corpus.jsonl"), "--transport", "streamable-http", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def stderr() -> str:  # read once it ended: a live server's pipe would block
            return proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "(still running)"

        wait_until(lambda: accepts_connections(port), timeout_s=60, while_=lambda: proc.poll() is None,
                   what=lambda: f"the search server listening; its stderr: {stderr()}")
        over_http, _ = run_async(episode(f"http://127.0.0.1:{port}/mcp"))
        assert over_http == first
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_search_server_cli_rejects_a_missing_corpus(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agentrl.tools.search_server", "--corpus", str(tmp_path / "no.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such file" in proc.stderr


# -- one training iteration --------------------------------------------------------------------------
@pytest.mark.e2e
def test_train_one_iteration(tmp_path):
    out = tmp_path / "run"
    # Short budgets keep the tiny random model's turns quick; several turns still happen.
    rows = train_one_iteration("search-r1", out, "--rollout-max-response-len", "160",
                               "--rollout-max-tokens-per-turn", "40")
    assert_iteration_ok(out, rows)
    assert rows[0]["turns_mean"] >= 1


class _Replies:
    """An engine that answers with scripted texts; `None` after a text: it ended on EOS."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.inputs = tokenizer, list(replies), []

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
        from agentrl.rollout.client import GenerateResult

        self.inputs.append(self.tok.decode(input_ids))
        text, eos = self.replies.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if eos else [])
        return GenerateResult(ids, [-0.25] * len(ids), "stop", len(input_ids), 0, "1")


@pytest.mark.parametrize("chat_template", [True, False])
def test_append_trajectory_is_search_r1s_text(run_async, tokenizer, chat_template):
    """A whole observation="append" episode through the agent loop, against Search-R1 at a14dc3a
    written out by hand: verl/utils/dataset/rl_dataset.py:128-131 renders the prompt with the chat
    template and the generation prompt (without a template: the prompt as it is); generation.py
    then concatenates each reply, cut after </search> (:69-75) and decoded with
    skip_special_tokens=True (:64-67, so a reply's EOS is not in the text), with the observation
    (:391, :396-398), tokenized alone with add_special_tokens=False (:86-92) and masked out of the
    loss (info_mask, :136-156). All of it stays one assistant turn: no <|im_start|> after the prompt."""
    from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory

    search = "<think>hm</think>\n<search> gamma </search>"  # stopped by the stop string: no EOS
    replies = [(search, False), ("no tags", True), ("<answer> Deloth </answer>", True)]
    client = _Replies(tokenizer, replies)

    async def main():
        runner, url, _ = await _retrieval_service()
        try:
            env = SearchR1Env(retriever_url=url, topk=2, observation="append")
            settings = LoopSettings(max_response_len=1000, max_turns=4, sampling_params={},
                                    apply_chat_template=chat_template)
            return await run_trajectory(env, TASK, renderer=Renderer(tokenizer, chat_template), client=client,
                                        settings=settings, trajectory_id="t", group_id=0, seed=0)
        finally:
            await runner.cleanup()

    sample = run_async(main())
    assert sample.status.value == "completed" and sample.reward == 1.0, sample.metadata
    # the env's own counts, averaged per episode in the metrics (searches per episode, answer format rate)
    assert sample.metadata["env_metrics"] == {"searches": 1.0, "invalid_actions": 1.0, "answered": 1.0}
    import dataclasses

    from agentrl.batches import rollout_metrics
    unanswered = dataclasses.replace(sample, metadata={"env_metrics": {"searches": 3.0}})
    m = rollout_metrics(0, [sample, unanswered], 1.0)
    assert (m["env/searches_mean"], m["env/answered_mean"], m["env/invalid_actions_mean"]) == (2.0, 0.5, 0.5)
    prefix = SEARCH_R1_INSTRUCTION + "Question: Who founded Vrokath Works?\n"
    prompt = f"<|im_start|>user\n{prefix}<|im_end|>\n<|im_start|>assistant\n" if chat_template else prefix
    information = ('\n\n<information>Doc 1(Title: "Title 0") About gamma: passage 0.\n'
                   'Doc 2(Title: "Title 1") About gamma: passage 1.</information>\n\n')
    invalid = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
               "</search>. If I want to give the final answer, I should put the answer between <answer> and "
               "</answer>. Let me try again.\n")
    assert tokenizer.decode(sample.prompt_tokens) == prompt
    assert client.inputs == [prompt, prompt + search + information, prompt + search + information + "no tags" + invalid]
    # the final EOS ends the episode and stays (trained on, as sampled); the middle one was taken back
    assert tokenizer.decode(sample.tokens) == client.inputs[-1] + "<answer> Deloth </answer><|im_end|>"
    runs, at = [], 0  # (mask, token ids) runs of the response
    for i in range(1, len(sample.loss_mask) + 1):
        if i == len(sample.loss_mask) or sample.loss_mask[i] != sample.loss_mask[at]:
            runs.append((sample.loss_mask[at], sample.response_tokens[at:i]))
            at = i

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    assert runs == [(1, enc(search)), (0, enc(information)), (1, enc("no tags")), (0, enc(invalid)),
                    (1, enc("<answer> Deloth </answer>") + [tokenizer.eos_token_id])]
    assert all(lp == -0.25 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if not m)


def test_append_observation_is_search_r1s_continuation(run_async):
    """observation="append" with --no-apply-chat-template: prompt + the model's text + Search-R1's
    observation, concatenated as generation.py:391 (and :396-398 for an invalid action) does."""
    from agentrl.rollout.agent_loop import Renderer

    async def main():
        runner, url, _ = await _retrieval_service()
        try:
            env = SearchR1Env(retriever_url=url, topk=2, observation="append")
            prompt, _ = await env.areset(options=TASK)
            action = "<think>hm</think>\n<search> gamma </search>"
            obs, *_ = await env.astep(action)
            bad, *_ = await env.astep("no tags")
            await env.aclose()
        finally:
            await runner.cleanup()
        text = Renderer(None, apply_chat_template=False).render(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": action}, *obs], None)
        assert text == (prompt + action + '\n\n<information>Doc 1(Title: "Title 0") About gamma: passage 0.\n'
                        'Doc 2(Title: "Title 1") About gamma: passage 1.</information>\n\n')
        assert bad[0]["content"] == ("\nMy previous action is invalid. If I want to search, I should put the query "
                                     "between <search> and </search>. If I want to give the final answer, I should "
                                     "put the answer between <answer> and </answer>. Let me try again.\n")
        with pytest.raises(ValueError, match="observation must be"):
            SearchR1Env(observation="turn")

    run_async(main())


def test_stdio_search_server_starts_when_mcp_was_imported_under_a_stderr_without_a_file():
    """The MCP SDK binds its stdio servers' stderr to the sys.stderr of when it was imported; under a
    notebook or a test's capture that object has no file descriptor and the spawn failed."""
    script = f"""
import asyncio, io, sys
sys.stderr = io.StringIO()
import mcp.client.stdio
sys.stderr = sys.__stderr__
from agentrl.envs.search_r1 import SearchR1Env

async def main():
    env = SearchR1Env(search_server="stdio", topk=1)
    await env.areset(options={TASK!r})
    try:
        obs, *_ = await env.astep("<search>Vrokath Works founder</search>")
    finally:
        await env.aclose()
    print(obs[0]["content"])

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "Doc 1" in out.stdout, out.stderr[-2000:]
