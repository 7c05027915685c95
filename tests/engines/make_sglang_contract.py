"""Regenerates sglang_contract.json: the field names and types of the pinned SGLang's HTTP
request structures, and the reply shapes of its handlers, without importing SGLang.

    python tests/engines/make_sglang_contract.py SITE_DIR > tests/engines/sglang_contract.json

SITE_DIR holds an unpacked `sglang` package (e.g. `python -m zipfile -e sglang-0.5.15-*.whl
SITE_DIR`). Request fields are read with `ast` from python/sglang/srt/managers/io_struct.py
(and sampling/sampling_params.py); reply shapes are written down below from
entrypoints/http_server.py and managers/tokenizer_manager.py (line numbers of 0.5.15), as
they are dict literals spread over handlers rather than declared types.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path

REQUESTS = {  # endpoint -> request structure (io_struct.py)
    "/generate": "GenerateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}
BASES = {"BaseReq": {"rid": "Optional[str]", "http_worker_ipc": "Optional[str]"}}

# http_server.py (0.5.15): status 200 on success unless noted; 400 with the same shape on failure
RESPONSES = {
    "/generate": {"kind": "json", "keys": {"text": "str", "output_ids": "List[int]", "meta_info": "dict"},
                  "where": "tokenizer_manager.py:1889-2110 (meta_info), 2166-2168 (logprobs)"},
    "/update_weights_from_tensor": {"kind": "json", "keys": {"success": "bool", "message": "str"},
                                    "where": "http_server.py:1264"},
    "/update_weights_from_disk": {"kind": "json", "keys": {"success": "bool", "message": "str",
                                                           "num_paused_requests": "int"},
                                  "where": "http_server.py:1128"},
    "/update_weights_from_distributed": {"kind": "json", "keys": {"success": "bool", "message": "str"},
                                         "where": "http_server.py:1286"},
    "/init_weights_update_group": {"kind": "json", "keys": {"success": "bool", "message": "str"},
                                   "where": "http_server.py:1232"},
    "/destroy_weights_update_group": {"kind": "json", "keys": {"success": "bool", "message": "str"},
                                      "where": "http_server.py:1248"},
    "/update_weight_version": {"kind": "json", "keys": {"success": "bool", "message": "str", "new_version": "str"},
                               "where": "http_server.py:1325"},
    "/pause_generation": {"kind": "json", "keys": {"message": "str", "status": "str"}, "where": "http_server.py:1577"},
    "/continue_generation": {"kind": "json", "keys": {"message": "str", "status": "str"},
                             "where": "http_server.py:1590"},
    "/release_memory_occupation": {"kind": "json_null", "where": "http_server.py:1374 (the handler returns None)"},
    "/resume_memory_occupation": {"kind": "json_null", "where": "http_server.py:1386"},
    "/abort_request": {"kind": "empty", "where": "http_server.py:1499"},
    "/load_lora_adapter": {"kind": "json", "keys": {"success": "bool", "error_message": "Optional[str]",
                                                    "loaded_adapters": "Optional[Dict[str, Union[str, LoRARef]]]"},
                           "where": "http_server.py:1431-1439 (LoRAUpdateOutput; 400 when not success)"},
    "/unload_lora_adapter": {"kind": "json", "keys": {"success": "bool", "error_message": "Optional[str]",
                                                      "loaded_adapters": "Optional[Dict[str, Union[str, LoRARef]]]"},
                             "where": "http_server.py:1454-1461 (LoRAUpdateOutput; 400 when not success)"},
    "/flush_cache": {"kind": "text", "where": "http_server.py:862"},
    "/health": {"kind": "empty", "where": "http_server.py:578"},
    "/health_generate": {"kind": "empty", "where": "http_server.py:579"},
    "/model_info": {"kind": "json", "keys": {"model_path": "str", "tokenizer_path": "Optional[str]",
                                             "is_generation": "bool", "preferred_sampling_params": "Optional[str]",
                                             "weight_version": "str", "has_image_understanding": "bool",
                                             "has_audio_understanding": "bool", "model_type": "Optional[str]",
                                             "architectures": "Optional[List[str]]"},
                    "where": "http_server.py:665"},
}
META_INFO = {  # always present in a finished non-streamed /generate reply (tokenizer_manager.py)
    "id": "str", "finish_reason": "dict", "prompt_tokens": "int", "weight_version": "str",
    "num_retractions": "int", "reasoning_tokens": "int", "completion_tokens": "int", "cached_tokens": "int",
    "e2e_latency": "float",
}
META_INFO_LOGPROB = {  # with return_logprob (convert_logprob_style)
    "input_token_logprobs": "List[List[Union[float, int, None]]]",
    "output_token_logprobs": "List[List[Union[float, int, None]]]",
    "output_token_logprobs_length": "int",
}
FINISH_REASONS = {  # schedule_batch.py BaseFinishReason.to_json
    "stop": {"type": "str", "matched": "Union[int, str, None]"},
    "length": {"type": "str", "length": "int"},
    "abort": {"type": "str", "message": "Optional[str]", "status_code": "Optional[int]", "err_type": "Optional[str]"},
}


def fields_of(tree: ast.Module, name: str) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            out: dict[str, str] = {}
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in BASES:
                    out.update(BASES[base.id])
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out[stmt.target.id] = ast.unparse(stmt.annotation)
            return out
    raise KeyError(name)


def main(site: str) -> None:
    root = Path(site) / "sglang"
    io_struct = root / "srt/managers/io_struct.py"
    sampling = root / "srt/sampling/sampling_params.py"
    tree = ast.parse(io_struct.read_text())
    requests = {ep: {"struct": cls, "fields": fields_of(tree, cls)} for ep, cls in REQUESTS.items()}
    sp = fields_of(ast.parse(sampling.read_text()), "SamplingParams")
    version = (root / "_version.py").read_text().split("__version__ = version = ")[1].split("\n")[0].strip("'\"")
    files = [io_struct, sampling, root / "srt/entrypoints/http_server.py", root / "srt/managers/tokenizer_manager.py"]
    json.dump({
        "source": {
            "package": f"sglang=={version}",
            "from": "the PyPI wheel sglang-0.5.15-cp312-cp312-manylinux_2_34_x86_64.whl (sha256 b737df527bbba96f"
                    "e098a02d182e98f72a1b3564d7fc754629041129a5d8edc1); its _version.py records no commit id: the git "
                    "tag is v0.5.15 of github.com/sgl-project/sglang",
            "files": {str(f.relative_to(root.parent)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
            "made_by": "tests/engines/make_sglang_contract.py",
        },
        "requests": requests,
        "sampling_params": sp,
        "responses": RESPONSES,
        "meta_info": META_INFO,
        "meta_info_logprob": META_INFO_LOGPROB,
        "finish_reasons": FINISH_REASONS,
    }, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
