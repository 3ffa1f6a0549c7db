"""Conversations to prompts, rendered with the checkpoint's chat template (vLLM's LLM.chat and its server's chat
completions): ``LLM.chat`` and the server both come through here."""

from __future__ import annotations

from lessonlib.engine.requests import tokenize


def chat_prompts(tokenizer, messages, chat_template: str | None, add_generation_prompt: bool,
                 max_chars: int | None = None) -> list[dict]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, to prompts for ``generate``: the
    rendered text's token ids, tokenized without adding special tokens (the template wrote them: BOS included, so a
    Llama 3 prompt has one BOS, not two), and the text. A checkpoint without a chat template is refused (no format
    is guessed); ``max_chars`` bounds the conversation's text before it is rendered and the rendered text before it
    is tokenized."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer: this checkpoint has none")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat needs a conversation (a non-empty list of messages) or a list of them")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template: chat is not available for it (send "
                         "the prompt text to completions instead)")
    max_chars = max_chars if max_chars is not None else float("inf")
    prompts = []
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conversation):
            raise ValueError("a conversation is a non-empty list of messages, each a dict with 'role' and 'content'")
        if sum(len(str(m["content"])) for m in conversation) > max_chars:
            raise ValueError(f"prompt: the conversation cannot fit the context: more than {max_chars} characters")
        text = tokenizer.apply_chat_template(list(conversation), chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        ids = tokenize(tokenizer, text, max_chars, add_special_tokens=False)
        prompts.append({"prompt_token_ids": ids, "prompt": text})
    return prompts
