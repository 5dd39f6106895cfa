"""What a run shows people: the HTML report and the model cards."""
