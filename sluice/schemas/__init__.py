"""The HTTP schemas of each dialect (OpenAI, Anthropic, Responses), their error shapes, and the decision for
every field of the official SDKs."""
