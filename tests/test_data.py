import json

import pytest

from agentrl.data import PromptSource, read_rows
from agentrl.errors import DatasetError


def test_jsonl_and_parquet_rows(tmp_path):
    rows = [{"question": "q1", "golden_answers": ["a"], "meta": {"k": 1}},
            {"question": [{"role": "user", "content": "q2"}], "golden_answers": ["b"], "env": "target-token"}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = read_rows(str(p), input_key="question", label_key="golden_answers", metadata_key="meta")
    assert tasks[0] == {"prompt": "q1", "label": ["a"], "metadata": {"k": 1}}
    assert tasks[1]["env"] == "target-token" and tasks[1]["prompt"][0]["content"] == "q2"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "label": "y"}]), tmp_path / "d.parquet")
    assert read_rows(str(tmp_path / "d.parquet"))[0]["label"] == "y"


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": \n', r"d.jsonl:2: not valid JSON"),
    ('{"prompt": "ok"}\n{"question": "x"}\n', r"d.jsonl:2: no 'prompt' key \(set --input-key\)"),
    ('{"prompt": ""}\n', r"d.jsonl:1: the prompt must be a non-empty string"),
    ('[1, 2]\n', r"d.jsonl:1: a row must be a JSON object"),
    ('', r"d.jsonl: no rows"),
])
def test_bad_rows_name_file_and_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=message):
        read_rows(str(tmp_path / "d.jsonl"))


def test_missing_file():
    with pytest.raises(DatasetError, match="--prompt-data /nope.jsonl: no such file"):
        read_rows("/nope.jsonl")


def test_position_restores_exactly_for_lists_and_generators():
    tasks = [{"prompt": f"p{i}"} for i in range(5)]
    a = PromptSource(tasks, seed=1)
    a.next_batch(3)
    state = a.state_dict()
    expected = [t["prompt"] for t in a.next_batch(6)]  # crosses an epoch boundary
    b = PromptSource(tasks, seed=1)
    b.load_state_dict(state)
    assert [t["prompt"] for t in b.next_batch(6)] == expected

    def gen():
        i = 0
        while True:
            yield {"prompt": f"g{i}"}
            i += 1

    g = PromptSource(generator=gen)
    g.next_batch(4)
    h = PromptSource(generator=gen)
    h.load_state_dict(g.state_dict())
    assert [t["prompt"] for t in h.next_batch(2)] == ["g4", "g5"]
