"""Registers the command agent of agent.py as the env `code-command-agent`: it runs in each
trajectory's sandbox (the code env's, so the hidden tests grade the solution.py it writes).
The program's source goes in on its command line: the sandbox sees no host file."""
import shlex
from pathlib import Path

from agentrl.gateway import agent_env

SOURCE = Path(__file__).with_name("agent.py").read_text()

agent_env("code-command-agent", grader="code", timeout_s=300, max_turns=3,
          command=f"python3 -c {shlex.quote(SOURCE)}",
          description="A plain-program code agent in its sandbox, graded by the code env's hidden tests")(None)
