"""The Renderer's fast paths (issue 16: rollout overhead) give exactly what the tokenizer's
own calls give: the chat template rendered without apply_chat_template's set-up, encode/decode
on a private copy of the Rust tokenizer, and the first rendering remembered across a group."""

import pytest

from agentrl.rollout.agent_loop import Renderer

TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "sure? ünïcødé 🙂\n\n  spaces"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
     {"role": "tool", "content": "42", "name": "python"}],
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_render_is_apply_chat_template(tokenizer, messages, tools):
    renderer = Renderer(tokenizer, True)
    expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert renderer.render(messages, tools) == expected
    # a message with a None field goes the tokenizer's own way (its normalisation differs across versions)
    with_none = [*messages[:-1], {**messages[-1], "reasoning_content": None}]
    assert renderer.render(with_none, tools) == tokenizer.apply_chat_template(
        with_none, tools=tools, tokenize=False, add_generation_prompt=True)


def test_encode_and_decode_are_the_tokenizers(tokenizer):
    renderer = Renderer(tokenizer, True)
    assert renderer._backend is not None  # the fast path is the one under test
    texts = ["", "plain words", "  leading and trailing  ", "ünïcødé 🙂 \n\t tabs", tokenizer.eos_token + "after",
             tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert renderer.encode(text) == ids
        assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False,
                                                        clean_up_tokenization_spaces=False)
    # truncation set on the shared tokenizer's backend by someone else does not reach ours
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    try:
        assert len(renderer.encode("many many many words here")) > 2
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_the_first_rendering_is_remembered_and_never_shared_mutably(tokenizer):
    renderer = Renderer(tokenizer, True)
    text, ids = renderer.prompt(CONVERSATIONS[1], TOOLS)
    assert text == renderer.render(CONVERSATIONS[1], TOOLS) and ids == renderer.encode(text)
    ids.append(-1)  # a sample's tokens grow: the cache must not
    again_text, again = renderer.prompt(CONVERSATIONS[1], TOOLS)
    assert again_text == text and again == ids[:-1]
    assert renderer.prompt(CONVERSATIONS[1], None)[0] != text  # tools are part of the key
    assert renderer.prompt([{"role": "user", "content": object()}], None)  # not JSON: rendered, not cached


def test_plain_messages_skip_transformers_copying_and_the_rest_go_through_it(tokenizer, monkeypatch):
    """Messages whose fields are role/content/name/tool_call_id strings render with the compiled
    template directly; reasoning fields, content blocks and non-JSON tools take transformers'
    render_jinja_template as before. Both give exactly apply_chat_template's text."""
    import agentrl.rollout.agent_loop as agent_loop

    through = []
    real = agent_loop._render_jinja_template
    monkeypatch.setattr(agent_loop, "_render_jinja_template", lambda *a, **kw: through.append(1) or real(*a, **kw))
    renderer = Renderer(tokenizer, True)
    for tools in (None, TOOLS):
        for messages in CONVERSATIONS:
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert renderer.render(messages, tools) == expected
    assert through == []  # every one of them took the direct path
    others = [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
          {"role": "user", "content": "and?"}], None),  # transformers aliases reasoning fields
        ([{"role": "user", "content": [{"type": "text", "text": "blocks"}]}], None),  # not a str
        (CONVERSATIONS[0], [{**TOOLS[0], "tags": ("a", "b")}]),  # a tuple in the tools: not plain JSON
    ]
    for messages, tools in others:
        expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert renderer.render(messages, tools) == expected
    assert len(through) == len(others)


SANDBOX_PROBES = [
    "{% for m in messages %}{{ loop.index }}{{ loop.first }}{{ m.role }}:{{ m.content }}{{ m.missing }}{% endfor %}",
    "{{ messages[0].items() | list }}{{ messages[0].get('role') }}{{ messages | length }}",
    "{% for m in messages %}{{ loop.cycle('a', 'b') }}{{ loop.revindex }}{{ loop.nextitem.role if loop.nextitem }}{% endfor %}",
    "{{ messages.__class__ }}",
    "{{ messages[0].__class__.__mro__ }}",
    "{{ messages[0].pop('role') }}",
    "{{ messages[0].update({'x': 1}) }}",
    "{{ messages[0].__init__ }}",
    "{% for m in messages %}{{ loop._after }}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% set ns = namespace(x=1) %}{% set ns.x = 2 %}{{ ns.x }}{{ ns.__class__ }}",
    "{{ raise_exception('no') if messages | length > 5 }}{{ messages | tojson }}",
]


@pytest.mark.parametrize("source", SANDBOX_PROBES)
def test_fast_template_keeps_the_sandbox(source):
    """The render path's fast lookups (agent_loop._fast_sandbox_template) give what transformers'
    sandboxed template gives, refusals included: the same text or the same error."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from agentrl.rollout.agent_loop import _fast_sandbox_template

    def outcome(template):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        try:
            return "ok", template.render(messages=messages, tools=None, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - the error is what is compared
            return type(exc).__name__, str(exc)

    reference = _compile_jinja_template(source)
    fast = _fast_sandbox_template(reference, source)
    assert fast is not None and type(fast.environment) is not type(reference.environment)
    assert outcome(fast) == outcome(reference)
