"""`deltamoe demo`: the whole stack in one command on a CPU.

One concern per file: run_folder (layout, reuse, atomic writes), train_stage (the recipe and
the trainer), train_estimate (the up-front training time), serve_stage (LLMEngine on held-out
prompts), plan_stage (K3.1 Pro deployment plans), trace_stage (the analyzer on the recorded
profiler steps), command (the typer command).
"""
