"""What lets the released checkpoints and their own scripts run on our classes: config files in and out and complete
weights (`checkpoint`), the call forms of the released generate scripts (`calls`), their cache objects (`caches`) and
their attention masks (`masks`) (docs/fidelity.md, "Model families")."""
