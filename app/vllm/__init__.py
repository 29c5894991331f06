"""The vLLM job (`kvplane run --engine vllm`, `kvplane proxy`, `kvplane attack`): engines, the
proxy, the tiny model, the workload, the KV check and the report.
"""
