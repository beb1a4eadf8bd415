"""``rollout jobs show ID [--text]``: a job's trajectory in the terminal, as the dashboard's job
page shows it.

The trainer's machine has no model, so the text comes from the server (``GetJob`` with
``include_text``: one decoded piece per token, decoded with the served model's tokenizer);
without ``--text`` the turns show their raw token ids. Generated tokens (loss mask 1) are
shaded by their sampling probability, prompt and observation tokens (loss mask 0) are dim.
Model text is printed as plain text, never as markup, and control characters are shown
escaped: a hostile model cannot restyle or take over the terminal.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from rollout.client.aio import RolloutClient
from rollout.v1 import job_pb2, trajectory_pb2
from rollout.v1 import rollout_service_pb2 as pb

# Probability bounds and background colours of the shades (as the dashboard's lp0..lp5).
SHADES = ((0.9, ""), (0.7, "on #5f5f00"), (0.5, "on #875f00"), (0.3, "on #af5f00"),
          (0.1, "on #af3f00"), (0.0, "on #af0000"))
PROMPT_STYLE = "grey50"
OBSERVATION_STYLE = "green4"


def shade_style(logprob: float) -> str:
    p = math.exp(logprob) if logprob < 0 else 1.0
    for bound, style in SHADES:
        if p >= bound:
            return style
    return SHADES[-1][1]


def visible(piece: str) -> str:
    """``piece`` with control characters (ESC and friends) escaped, newlines and tabs kept."""
    if piece.isprintable() or all(c.isprintable() or c in "\n\t" for c in piece):
        return piece
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}"
                   for c in piece)


def _name(enum: object, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)  # type: ignore[attr-defined]


def render(resp: pb.GetJobResponse, console: Console) -> None:
    job, traj = resp.job, resp.trajectory
    state = _name(job_pb2.Job.State, job.state, "STATE_")
    console.print(Text.assemble(("job ", "bold"), (job.job_id, "bold cyan"),
                                f"  {state}  env {job.spec.environment}",
                                f"  group {job.spec.group.group_id}" if job.spec.group.group_id
                                else ""))
    if job.HasField("error") and job.error.reason:
        console.print(Text(f"error: {job.error.reason}: {visible(job.error.message)}",
                           style="red"))
    if not resp.HasField("trajectory"):
        console.print("no trajectory (the job has not finished, or retention pruned it)")
        return
    generated = sum(len(t.output_ids) for t in traj.turns)
    total = sum(len(t.prompt_ids) + len(t.output_ids) + len(t.observation_ids)
                for t in traj.turns)
    parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(traj.reward_components.items()))
    ended = _name(trajectory_pb2.TerminationReason, traj.termination_reason,
                  "TERMINATION_REASON_")
    console.print(f"reward {traj.reward:.4f}" + (f" ({parts})" if parts else "")
                  + f"  ·  ended by {ended}  ·  {len(traj.turns)} turn(s), {total} tokens "
                  f"({generated} generated)")
    legend = Text("legend: ")
    legend.append("prompt", PROMPT_STYLE).append(" · ")
    legend.append("observation", OBSERVATION_STYLE).append(" · generated, p ")
    for bound, style in SHADES:
        legend.append(f"≥{bound:g}" if bound else "<0.1", style or "bold").append(" ")
    console.print(legend)
    texts: Sequence[pb.TurnText] = resp.text
    for i, turn in enumerate(traj.turns):
        finish = _name(trajectory_pb2.FinishReason, turn.finish_reason, "FINISH_REASON_")
        tools = f" · tools {', '.join(turn.tool_calls)}" if turn.tool_calls else ""
        console.rule(Text(f"turn {i + 1} · policy version {turn.policy_version} · {finish}"
                          f"{visible(tools)}"), align="left")
        text = texts[i] if i < len(texts) else None
        console.print(turn_text(turn, text))


def turn_text(turn: trajectory_pb2.Turn, text: pb.TurnText | None) -> Text:
    out = Text()

    def ids(values: Sequence[int], style: str) -> None:
        out.append(" ".join(str(v) for v in values) + "\n", style)

    if text is None:  # raw ids (no --text)
        ids(turn.prompt_ids, PROMPT_STYLE)
        for k, tid in enumerate(turn.output_ids):
            lp = turn.output_logprobs[k] if k < len(turn.output_logprobs) else 0.0
            out.append(str(tid), shade_style(lp) or "bold").append(" ")
        out.append("\n")
        if turn.observation_ids:
            ids(turn.observation_ids, OBSERVATION_STYLE)
        return out
    out.append(visible("".join(text.prompt)), PROMPT_STYLE)
    for k, piece in enumerate(text.output):
        lp = turn.output_logprobs[k] if k < len(turn.output_logprobs) else 0.0
        out.append(visible(piece), shade_style(lp) or "bold")
    out.append(visible("".join(text.observation)), OBSERVATION_STYLE)
    return out


async def show(args: argparse.Namespace, client: RolloutClient, console: Console) -> int:
    resp = await client.get_job(args.job_id, include_trajectory=True, include_text=args.text)
    render(resp, console)
    return 0
