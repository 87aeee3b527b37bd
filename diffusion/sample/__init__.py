"""From a trained model to images and numbers: generate (prompt grids), export (a diffusers pipeline
directory), evaluate (CLIP score, FID, prompt adherence), grid (labelled PNG grids that carry their prompts)."""
