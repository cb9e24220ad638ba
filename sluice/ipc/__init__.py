"""Everything that crosses a process boundary: messages, codec, transports."""
