"""Our trajectory in NeMo RL's shapes: Gym output items and the ``message_log`` it trains on.

NeMo RL's Gym path (``nemo_rl/environments/nemo_gym.py``) reads one output item per model call
carrying ``prompt_token_ids`` (the whole prompt of that call), ``generation_token_ids`` and
``generation_log_probs``. It asserts that every call's prompt starts with every token seen
before (contiguity), then turns each call into two messages: a non-trained one holding the new
part of the prompt, and an assistant one holding the generation and its logprobs. GRPO then sets
``token_loss_mask`` to ones on assistant messages and zeros elsewhere.

A trajectory of this service is contiguous by construction (turn ``k``'s prompt is everything
before its output: earlier turns, their observations, and its own prompt delta), so both shapes
follow from the turns without any re-tokenization. Tool observations after the last generation
are in no model call's prompt, so, as in NeMo RL's own flattening, they appear in neither.

A harness trajectory whose harness rewrote its history holds several token sequences
(``Trajectory.segments``) and is not contiguous across them. NeMo RL takes one contiguous
sequence per sample, so both shapes hold the last segment (the one that ends the episode and
was graded); the others are not sent.
"""

from __future__ import annotations

from typing import Any

from rollout.client.trajectory import segment_views
from rollout.v1 import trajectory_pb2

PLACEHOLDER_TOKEN = 0
"""The token of the placeholder item a turnless trajectory answers with (every vocabulary has
an id 0); it sits beside ``mask_sample: true`` and is never trained on."""


def gym_output_items(traj: trajectory_pb2.Trajectory) -> list[dict[str, Any]]:
    """One token-carrying output item per turn (a ``function_call`` when the model called a
    tool, else an assistant ``message``), each followed by a ``function_call_output`` when the
    turn's tool answered. Text fields are empty: token ids are authoritative and the service does
    not return per-turn text. A trajectory without turns gets one placeholder message (NeMo RL
    fails a result that has no token-carrying item before it reads ``mask_sample``)."""
    if not traj.turns:
        return [{"type": "message", "id": "msg_placeholder", "role": "assistant",
                 "status": "incomplete",
                 "content": [{"type": "output_text", "text": "", "annotations": []}],
                 "prompt_token_ids": [PLACEHOLDER_TOKEN],
                 "generation_token_ids": [PLACEHOLDER_TOKEN], "generation_log_probs": [0.0]}]
    items: list[dict[str, Any]] = []
    seen: list[int] = []
    for k, turn in enumerate(segment_views(traj)[-1].turns):
        prompt = seen + list(turn.prompt_ids)
        tokens = {"prompt_token_ids": prompt, "generation_token_ids": list(turn.output_ids),
                  "generation_log_probs": [float(x) for x in turn.output_logprobs]}
        if len(turn.tool_calls):
            items.append({"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{k}",
                          "name": turn.tool_calls[0], "arguments": "{}",
                          "status": "completed", **tokens})
        else:
            items.append({"type": "message", "id": f"msg_{k}", "role": "assistant",
                          "status": "completed",
                          "content": [{"type": "output_text", "text": "", "annotations": []}],
                          **tokens})
        if len(turn.observation_ids):
            items.append({"type": "function_call_output", "call_id": f"call_{k}",
                          "output": "", "status": "completed"})
        seen = prompt + list(turn.output_ids) + list(turn.observation_ids)
    return items


def to_message_log(traj: trajectory_pb2.Trajectory, *, as_tensors: bool = False
                   ) -> list[dict[str, Any]]:
    """NeMo RL's ``message_log`` for a trajectory: per turn a ``user`` message with the tokens
    added since the last generation (the previous observation and this turn's prompt delta) and
    an ``assistant`` message with the generation and its ``generation_logprobs``; each with its
    ``token_loss_mask``. ``as_tensors`` gives torch tensors, as NeMo RL's own messages hold."""
    log: list[dict[str, Any]] = []
    pending: list[int] = []  # the previous turn's observation, not yet in any message
    for turn in segment_views(traj)[-1].turns:
        new_prompt = pending + list(turn.prompt_ids)
        log.append({"role": "user", "content": "", "token_ids": new_prompt,
                    "token_loss_mask": [0] * len(new_prompt)})
        log.append({"role": "assistant", "content": "", "token_ids": list(turn.output_ids),
                    "token_loss_mask": [1] * len(turn.output_ids),
                    "generation_logprobs": [float(x) for x in turn.output_logprobs]})
        pending = list(turn.observation_ids)
    if as_tensors:
        import torch

        for msg in log:
            msg["token_ids"] = torch.tensor(msg["token_ids"], dtype=torch.int64)
            msg["token_loss_mask"] = torch.tensor(msg["token_loss_mask"], dtype=torch.int64)
            if "generation_logprobs" in msg:
                msg["generation_logprobs"] = torch.tensor(msg["generation_logprobs"],
                                                          dtype=torch.float32)
    return log
