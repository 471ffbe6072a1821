"""SGLang's wire surface in one place (tensor payload formats; see sglang_types and payloads).

Nothing here imports sglang: its class names are mapped to our own vetted code.
"""
