"""``LLM.chat``'s conversations to prompts: each rendered with the tokenizer's chat template, as vLLM's LLM.chat."""

from __future__ import annotations


def chat_prompts(tokenizer, messages, chat_template: str | None, add_generation_prompt: bool) -> list[dict]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, to prompts for ``generate``: the
    rendered text's token ids, tokenized without adding special tokens (the template wrote them), and the text."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer: this checkpoint has none")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat needs a conversation (a non-empty list of messages) or a list of them")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass chat_template=...")
    prompts = []
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conversation):
            raise ValueError("a conversation is a non-empty list of messages, each a dict with 'role' and 'content'")
        text = tokenizer.apply_chat_template(list(conversation), chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
    return prompts
