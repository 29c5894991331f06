"""`kvplane sequence`: both sides' event logs as one Mermaid sequence diagram (the model, the
Mermaid text, the command).
"""
