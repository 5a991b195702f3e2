package cli

import "github.com/claudebox/claudebox/boxcore"

// defaultImage is used until templates pick one.
const defaultImage = "images:debian/12/cloud"

// applyTemplate fills image, resources and first-boot config from the chosen template.
func applyTemplate(c *Ctx, o *boxcore.NewOptions) error {
	if o.Image == "" {
		o.Image = defaultImage
	}
	return nil
}
