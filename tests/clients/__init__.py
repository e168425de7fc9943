"""Fake, scripted model APIs on loopback (Anthropic Messages, OpenAI Responses) that the
real Claude Code and Codex CLIs talk to in tests/test_real_clients.py; each records what the
client sent back to the model (turns.jsonl). Run as scripts: ``python fake_anthropic.py
--port 0 --script SCRIPT.json --out RUN_DIR``."""
