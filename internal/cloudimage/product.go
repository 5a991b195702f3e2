package cloudimage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// RecipeProperty is the image property holding the recipe hash (metadata.yaml's
// properties.claudebox.recipe): how BuildAlias knows an image is already the one it would build.
const RecipeProperty = "claudebox.recipe"

// AliasOptions are the choices of BuildAlias (`claudebox image build`).
type AliasOptions struct {
	Alias string // the alias to create or move
	// Rebuild runs debootstrap again even when the cached tarball or the aliased image is of
	// this recipe.
	Rebuild bool
	// NeedTools is called before a build that needs debootstrap (not before an import of a
	// cached tarball); its error stops the build. nil: Build's own checks.
	NeedTools func() error
}

// AliasResult says what BuildAlias did.
type AliasResult struct {
	Alias       string
	Fingerprint string
	Hash        string
	UpToDate    bool   // the alias already pointed at an image of this recipe: nothing done
	Built       bool   // debootstrap ran
	Cached      string // the cached tarball that was imported (when not built)
	Replaced    string // the image the alias pointed at before (another recipe, or --rebuild)
	Removed     bool   // that image was deleted (no other alias, not the new image)
	BuildTime   time.Duration
	ImportTime  time.Duration
}

// BuildAlias makes alias point at the image of recipe r in the daemon — the product side of
// Ensure (`claudebox image build`), with a name of the user's choice. When the alias already
// points at an image of this recipe (its claudebox.recipe property) it does nothing, unless
// o.Rebuild. Otherwise it builds the tarball (unless cached under the recipe hash and not
// o.Rebuild), imports it, and creates the alias or moves it to the new image; the image the
// alias left is deleted when no other alias names it. Builders of one recipe take turns
// (the cache's lock file), tests and users alike.
func BuildAlias(ctx context.Context, c *incus.Client, r Recipe, o AliasOptions, log io.Writer) (AliasResult, error) {
	if log == nil {
		log = io.Discard
	}
	hash := r.Hash()
	res := AliasResult{Alias: o.Alias, Hash: hash}
	if o.Alias == "" {
		return res, fmt.Errorf("cloudimage: no alias")
	}
	old, err := c.ImageByAlias(ctx, o.Alias)
	switch {
	case err == nil:
		if old.Properties[RecipeProperty] == hash && !o.Rebuild {
			res.UpToDate, res.Fingerprint = true, old.Fingerprint
			return res, nil
		}
	case errors.Is(err, incus.ErrNotFound):
		old = incus.Image{}
	default:
		return res, err
	}

	unlock, err := lockRecipe(ctx, hash)
	if err != nil {
		return res, err
	}
	defer unlock()

	path := CachePath(hash)
	_, statErr := os.Stat(path)
	if o.Rebuild || statErr != nil {
		if o.NeedTools != nil {
			if err := o.NeedTools(); err != nil {
				return res, err
			}
		}
		t0 := time.Now()
		if err := Build(ctx, r, path, log); err != nil {
			return res, err
		}
		res.Built, res.BuildTime = true, time.Since(t0)
		fmt.Fprintf(log, "cloudimage: built %s in %s\n", path, res.BuildTime.Round(time.Second))
	} else {
		res.Cached = path
		fmt.Fprintf(log, "cloudimage: using the cached %s (recipe %s; --rebuild runs debootstrap again)\n", path, hash[:12])
	}

	t0 := time.Now()
	fmt.Fprintf(log, "cloudimage: importing into the daemon ...\n")
	fp, err := importFile(ctx, c, path)
	if err != nil {
		return res, err
	}
	res.Fingerprint, res.ImportTime = fp, time.Since(t0)
	if err := c.PointImageAlias(ctx, o.Alias, fp); err != nil {
		return res, fmt.Errorf("cloudimage: %w", err)
	}
	fmt.Fprintf(log, "cloudimage: imported %s as %s in %s\n", fp[:12], o.Alias, res.ImportTime.Round(100*time.Millisecond))
	if old.Fingerprint != "" && old.Fingerprint != fp {
		res.Replaced = old.Fingerprint
		removed, err := c.DeleteImageIfUnaliased(ctx, old.Fingerprint)
		if err != nil {
			fmt.Fprintf(log, "cloudimage: could not delete the replaced image %s: %v\n", old.Fingerprint[:12], err)
		}
		res.Removed = removed
	}
	return res, nil
}

// MissingTools is CheckRequirements worded for the product command: what to install.
func MissingTools() error {
	if m := missingRequirements(); len(m) > 0 {
		return fmt.Errorf("the image build needs %s, which is not installed: run 'sudo apt-get install %s' (or 'sudo make setup' in claudebox's source tree)",
			strings.Join(m, ", "), strings.Join(m, " "))
	}
	return nil
}
