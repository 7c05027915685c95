"""A code agent as a plain program: no agentrl, no SDK, only the Python standard library.

It runs inside the trajectory's sandbox, where agentrl sets OPENAI_BASE_URL (the sandbox's own
loopback, bridged to this trajectory's session), OPENAI_API_KEY, AGENTRL_TASK (the task, JSON,
without its hidden tests) and AGENTRL_MESSAGES (the code env's first messages, JSON). It asks
for a solution, writes the last ```python block to solution.py, checks that it imports, and
sends the error back for another try (3 turns at most). The code env's hidden tests then grade
the solution.py it left in the sandbox. Any language that speaks HTTP works the same way.
"""
import json
import os
import re
import subprocess
import sys
import urllib.request

BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", "none")
TURNS = 3
SYSTEM = ("You are a careful Python programmer. Answer with the complete solution in one ```python block; "
          "it is saved as solution.py and graded by hidden tests.")


def chat(messages):
    body = json.dumps({"model": "policy", "messages": messages}).encode()
    request = urllib.request.Request(BASE + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": "Bearer " + KEY})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def main():
    given = json.loads(os.environ.get("AGENTRL_MESSAGES") or "[]")
    if not given:  # no grader env: the task's prompt
        given = [{"role": "user", "content": json.loads(os.environ["AGENTRL_TASK"])["prompt"]}]
    # the code env's own system prompt speaks of its tools; this agent has none but the file
    messages = [{"role": "system", "content": SYSTEM}] + [m for m in given if m["role"] != "system"]
    for _ in range(TURNS):
        text = chat(messages).get("content") or ""
        messages.append({"role": "assistant", "content": text})  # sent back as given: one unbroken sample
        blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", text, re.S)
        if not blocks:
            break
        with open("solution.py", "w") as f:
            f.write(blocks[-1])
        check = subprocess.run([sys.executable, "-c", "import solution"], capture_output=True, text=True, timeout=10)
        if check.returncode == 0:
            break
        messages.append({"role": "user", "content": "Importing solution.py failed:\n" + check.stderr[-2000:]
                         + "\nSend the whole corrected file."})
    print("solution.py written" if os.path.exists("solution.py") else "no solution")


if __name__ == "__main__":
    main()
