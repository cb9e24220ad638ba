"""`sluice router`: one endpoint in front of many Sluice servers. It relays every dialect's requests as bytes,
to the replica whose prefix cache holds most of the prompt (each engine publishes its block events), or
through a context worker then a generation worker (disaggregated serving). It renders prompts only to hash
them as the engines do."""
