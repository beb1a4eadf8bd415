"""A child process for resource tests: a real gateway over the scripted policy with open
leases; prints one ``socket_path key`` line per lease and serves until stdin closes.

``python -m tests.server.gateway.serve_one_lease [LEASES [NOFILE [TCP]]]``: NOFILE sets the
process's descriptor limit (soft and hard), so a flood meets it without exhausting the test
machine; TCP = 1 also serves the TCP listener (its port is printed last)."""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile

from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import smollm2_tokenizer


async def main(leases: int, tcp: bool) -> None:
    tok = smollm2_tokenizer()
    scripts = {f"job-{i}": ["fine"] * 512 for i in range(leases)}
    engine = ScriptedEngine(tok, scripts, end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    pool = BackendPool([engine], health_interval_s=0)
    with tempfile.TemporaryDirectory() as state:
        gateway = await Gateway(state, tcp_port=0 if tcp else None).start()
        for i in range(leases):
            lease = await gateway.open(JobSpec(job_id=f"job-{i}", environment="harness",
                                               task={}, sampling=SamplingParams(seed=1),
                                               limits=Limits(max_turns=512)), pool)
            print(lease.socket_path, lease.api_key, flush=True)
        if tcp:
            print(gateway.tcp_port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await gateway.stop()
        await pool.close()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    if len(args) > 1:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args[1], args[1]))
    asyncio.run(main(args[0] if args else 1, bool(args[2]) if len(args) > 2 else False))
