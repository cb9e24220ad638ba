"""The anthropic dialect's routes (registered with ingress.routes.route / ingress.dialects.register)."""
