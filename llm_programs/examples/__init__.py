"""Three example programs, each runnable against a router (`make run`):

    python -m llm_programs.examples.multi_turn_chat --base-url http://127.0.0.1:8000
    python -m llm_programs.examples.branch_and_judge --base-url http://127.0.0.1:8000
    python -m llm_programs.examples.json_extraction --base-url http://127.0.0.1:8000

Each module has `program` and `inputs(n)` (n keyword dicts), which bench.programs runs.
"""

EXAMPLES = ("multi_turn_chat", "branch_and_judge", "json_extraction")
