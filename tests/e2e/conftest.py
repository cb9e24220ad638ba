MODEL = "builtin:tiny-chat"
