package cli

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/cloudimage"
)

// imageCommands is the `image` group's rows: the local Debian 12 cloud image for hosts that
// reach no image server.
func imageCommands() []Command {
	return []Command{
		{
			Name:     "image build",
			Examples: []string{"sudo claudebox image build", "sudo claudebox image build --rebuild --verbose"},
			Synopsis: "[--alias A] [--rebuild] [--verbose]",
			Summary:  "build the Debian 12 cloud image with debootstrap from this host's apt mirror and import it (the default image of a container 'new' once it exists)",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "alias", Usage: "the image alias to create or replace (default: " + boxcore.LocalImage + ", or $" + boxcore.LocalImageEnv + ")"},
				&cli.BoolFlag{Name: "rebuild", Usage: "run debootstrap again even when an image of this recipe exists or is cached"},
				&cli.BoolFlag{Name: "verbose", Usage: "also print debootstrap's own output"},
			},
			Action: buildImage,
		},
	}
}

func buildImage(c *Ctx) error {
	alias := c.String("alias")
	if alias == "" {
		alias = boxcore.DefaultLocalImage()
	}
	if strings.Contains(alias, ":") || strings.TrimSpace(alias) != alias || alias == "" {
		return boxcore.Usagef("image build: --alias %q: want a local alias without a remote (e.g. %s)", alias, boxcore.LocalImage)
	}
	if os.Geteuid() != 0 {
		return boxcore.Usagef("image build: needs root (debootstrap builds the root file system as root; the cache is %s): run it with sudo", cloudimage.CacheDir())
	}
	r := cloudimage.Default()
	c.Warn("image build: Debian %s (%s) from %s, recipe %s, as %s", r.Suite, r.Arch, r.Mirror, r.Hash()[:12], alias)
	log := &stageLog{w: c.Env.Stderr, all: c.Bool("verbose"), start: time.Now()}
	res, err := cloudimage.BuildAlias(c.Context.Context, c.Client, r, cloudimage.AliasOptions{
		Alias: alias, Rebuild: c.Bool("rebuild"),
		NeedTools: func() error {
			if err := cloudimage.MissingTools(); err != nil {
				return boxcore.Usagef("image build: %v", err)
			}
			return nil
		},
	}, log)
	log.flush()
	if err != nil {
		return err
	}
	fp := res.Fingerprint
	if len(fp) > 12 {
		fp = fp[:12]
	}
	switch {
	case res.UpToDate:
		c.Out("%s is up to date (image %s, recipe %s): nothing to do (--rebuild builds it again)", alias, fp, res.Hash[:12])
		return nil
	case res.Built:
		c.Out("%s: built and imported (image %s, build %.0fs, import %.1fs)", alias, fp, res.BuildTime.Seconds(), res.ImportTime.Seconds())
	default:
		c.Out("%s: imported from the cache (image %s, import %.1fs)", alias, fp, res.ImportTime.Seconds())
	}
	if res.Replaced != "" {
		what := "kept: another alias names it"
		if res.Removed {
			what = "deleted"
		}
		c.Out("replaced image %s (%s)", res.Replaced[:12], what)
	}
	if alias == boxcore.DefaultLocalImage() {
		c.Out("a container 'claudebox new' without --image now uses it: claudebox new --name work --container")
	} else {
		c.Out("use it with: claudebox new --name work --container --image %s", alias)
	}
	return nil
}

// stageLog passes the builder's own lines ("cloudimage: ...") to w with the time since the
// start, and debootstrap's output only when all is set.
type stageLog struct {
	mu    sync.Mutex
	w     io.Writer
	all   bool
	start time.Time
	buf   []byte
}

func (l *stageLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		l.line(string(l.buf[:i]))
		l.buf = l.buf[i+1:]
	}
	return len(p), nil
}

func (l *stageLog) line(s string) {
	if rest, ok := strings.CutPrefix(s, "cloudimage: "); ok {
		fmt.Fprintf(l.w, "image build: %s (%.0fs)\n", rest, time.Since(l.start).Seconds())
		return
	}
	if l.all {
		fmt.Fprintln(l.w, s)
	}
}

func (l *stageLog) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.buf) > 0 {
		l.line(string(l.buf))
		l.buf = nil
	}
}
