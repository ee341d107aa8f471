"""Prompts as users give them: files, strings and chats, checked and encoded (``prompts``), and the
one order a run sees them in (``seeds``). Nothing here imports Ray; Ray Data reads prompt files in
``ray_ppo.cluster.datasets``."""

from ray_ppo.data.prompts import (
    FORMATS,
    JSON_CHAT,
    JSON_CHAT_FIX,
    MESSAGES_FIX,
    ROLES,
    ROLES_FIX,
    VALUE_FIX,
    DataError,
    EncodedPrompts,
    Prompt,
    PromptEncoder,
    PromptShapeError,
    check_prompt_column,
    infer_format,
    is_blank,
    prompt_text,
    read_prompt_texts,
    read_texts,
    to_prompt,
    to_prompts,
    unknown_role,
)

__all__ = [
    "DataError", "EncodedPrompts", "FORMATS", "JSON_CHAT", "JSON_CHAT_FIX", "MESSAGES_FIX", "Prompt", "PromptEncoder",
    "PromptShapeError", "ROLES", "ROLES_FIX", "VALUE_FIX", "check_prompt_column", "infer_format", "is_blank",
    "prompt_text", "read_prompt_texts", "read_texts", "to_prompt", "to_prompts", "unknown_role",
]
