"""The fleet's state: backends (health, load, breakers), the engines' own metrics, the model
catalog and the tokenizer check; what routing chooses among."""
