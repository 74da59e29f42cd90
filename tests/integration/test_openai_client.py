"""The embedded server with the official ``openai`` Python client: chat completions, streamed
chat and streamed completions, an adapter chosen by ``model``, errors as the client expects them."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

MESSAGES = [
    {"role": "system", "content": "You are an agent in a text-based household environment."},
    {"role": "user", "content": "Task: put a mug in the coffeemachine. What is your next action?"},
]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_and_streamed_chat_say_the_same_greedily(embedded_server, adapters):
    path = adapters.random("chat-v1", seed=11)
    c = client(embedded_server)
    import httpx

    httpx.post(
        embedded_server.url + "/v1/load_lora_adapter",
        json={"lora_name": "chat-v1", "lora_path": str(path)},
        headers={"Authorization": f"Bearer {embedded_server.token}"},
        timeout=60,
    ).raise_for_status()
    try:
        for model in (embedded_server.base_name, "chat-v1"):
            full = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0.0)
            choice = full.choices[0]
            assert (
                choice.message.role == "assistant"
                and choice.message.content
                and choice.finish_reason in ("stop", "length")
            )
            assert full.usage.completion_tokens > 0 and full.model == model
            chunks = list(
                c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0.0, stream=True)
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == choice.finish_reason
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == choice.message.content
        # the adapter changes what is said: model picks it
        base = c.chat.completions.create(
            model=embedded_server.base_name, messages=MESSAGES, max_tokens=12, temperature=0.0
        )
        lora = c.chat.completions.create(model="chat-v1", messages=MESSAGES, max_tokens=12, temperature=0.0)
        assert base.choices[0].message.content != lora.choices[0].message.content
    finally:
        httpx.post(
            embedded_server.url + "/v1/unload_lora_adapter",
            json={"lora_name": "chat-v1"},
            headers={"Authorization": f"Bearer {embedded_server.token}"},
            timeout=60,
        )


def test_streamed_completion_with_a_stop_string(embedded_server):
    c = client(embedded_server)
    kw = dict(model=embedded_server.base_name, prompt="Task: find a mug.\n>", max_tokens=24, temperature=0.0)
    full = c.completions.create(**kw)
    text = full.choices[0].text
    parts = list(c.completions.create(**kw, stream=True))
    assert (
        "".join(p.choices[0].text for p in parts) == text
        and parts[-1].choices[0].finish_reason == full.choices[0].finish_reason
    )
    if len(text) > 4:  # a stop string in the middle: the stream holds it back and ends where the full one does
        stop = text[2:4]
        cut = c.completions.create(**kw, stop=[stop]).choices[0]
        streamed = list(c.completions.create(**kw, stop=[stop], stream=True))
        assert "".join(p.choices[0].text for p in streamed) == cut.text and stop not in cut.text
        assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_errors_are_the_clients_errors(embedded_server):
    c = client(embedded_server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-adapter", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=embedded_server.base_name, messages=[], max_tokens=4)


def test_chat_content_as_a_list_of_text_parts_is_the_joined_text(embedded_server):
    """OpenAI clients may send a message's content as text parts; they read as the parts joined by
    newlines (as vLLM joins them). Other parts (images, audio) are refused in one line."""
    c = client(embedded_server)
    kw = dict(model=embedded_server.base_name, max_tokens=8, temperature=0.0)
    task, question = "Task: put a mug in the coffeemachine.", "What is your next action?"
    as_parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": task}, {"type": "text", "text": question}]},
    ]
    as_text = [MESSAGES[0], {"role": "user", "content": f"{task}\n{question}"}]
    parts = c.chat.completions.create(messages=as_parts, **kw)
    text = c.chat.completions.create(messages=as_text, **kw)
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": task}, image]}], **kw)
    message = err.value.body["message"]
    assert message.startswith("messages[0].content has a 'image_url' part: ") and "\n" not in message, message


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_with_include_usage_ends_with_a_usage_chunk(embedded_server, kind):
    """``stream_options.include_usage``: as OpenAI, a last chunk with no choices and the request's usage,
    and ``usage`` null on every other chunk."""
    c = client(embedded_server)
    kw = dict(model=embedded_server.base_name, max_tokens=6, temperature=0.0)
    if kind == "chat":
        create, kw = c.chat.completions.create, {**kw, "messages": MESSAGES}
    else:
        create, kw = c.completions.create, {**kw, "prompt": "Task: find a mug.\n>"}
    full = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert len(chunks) >= 2 and all(ch.usage is None and ch.choices for ch in chunks[:-1])
    assert all(ch.usage is None for ch in create(**kw, stream=True))  # not asked for: no usage chunk
