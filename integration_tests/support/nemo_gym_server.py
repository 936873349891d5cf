"""Serve NeMo Gym's own ``vllm_model`` server app in front of a vLLM OpenAI server.

Run with the NeMo Gym venv's Python (scripts/nemo_gym_venv.sh), not the project's:

    python nemo_gym_server.py --vllm-url http://127.0.0.1:P/v1 --model NAME --port Q

It builds NeMo Gym's ``VLLMModel`` (``responses_api_models/vllm_model/app.py``) from its own
config class with ``return_token_id_information=True`` and serves the FastAPI app that
``VLLMModel.setup_webserver()`` returns (its own routes, session middleware and liveness
route) with uvicorn on 127.0.0.1. What is skipped is only NeMo Gym's launcher around it
(``run_webserver``: the head server, Ray, and the global config, which is handed over the way
the launcher hands it to a child server: the ``NEMO_GYM_CONFIG_DICT`` variable).
"""

from __future__ import annotations

import argparse
import json
import os

import uvicorn
from omegaconf import OmegaConf

from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-url", required=True, help="the vLLM server's base URL, ending in /v1")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # How NeMo Gym's launcher hands a child server its global config (global_config.py,
    # NEMO_GYM_CONFIG_DICT): here an empty one, so nothing parses this script's argv as Hydra's.
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps({"policy_model_name": args.model})

    config = VLLMModelConfig(
        host="127.0.0.1", port=args.port, entrypoint="app.py", name="policy_model",
        base_url=args.vllm_url, api_key="unused", model=args.model,
        return_token_id_information=True, uses_reasoning_parser=False,
    )
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                          global_config_dict=OmegaConf.create({}))
    server = VLLMModel(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
