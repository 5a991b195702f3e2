package boxcore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// LocalImage is the alias `claudebox image build` imports its Debian 12 cloud image under
// (debootstrap from the host's own apt mirror: for hosts that reach no image server).
const LocalImage = "claudebox/debian12-cloud"

// LocalImageEnv names another alias for LocalImage: `image build` builds into it and a
// container `new` without --image looks for it (tests use it to stay off the real alias).
const LocalImageEnv = "CLAUDEBOX_IMAGE_ALIAS"

// DefaultLocalImage is $CLAUDEBOX_IMAGE_ALIAS, else LocalImage.
func DefaultLocalImage() string {
	if a := os.Getenv(LocalImageEnv); a != "" {
		return a
	}
	return LocalImage
}

// LocalDefaultImage returns the local image a container `new` without --image uses instead
// of its template's image server: DefaultLocalImage when that alias exists on this daemon,
// else "". The choice is by existence, not by probing the server: building the image is the
// user's own opt-in, and `new` then works the same with or without a network to the server.
func (bs *Boxes) LocalDefaultImage(ctx context.Context) (string, error) {
	alias := DefaultLocalImage()
	_, err := bs.Client.ImageAlias(ctx, alias)
	switch {
	case err == nil:
		return alias, nil
	case errors.Is(err, incus.ErrNotFound):
		return "", nil
	}
	return "", err
}

// missingImage is the usage error of a local alias that does not exist: say how to make it.
func missingImage(ref string) error {
	if ref == DefaultLocalImage() {
		return Usagef("new: no image %q on this daemon: run 'sudo claudebox image build' (Debian 12 with cloud-init, built with debootstrap from this host's apt mirror), "+
			"or pass --image REMOTE:ALIAS (e.g. images:debian/12/cloud)", ref)
	}
	return Usagef("new: no image %q on this daemon: pick one from 'incus image list', name a remote image as REMOTE:ALIAS (e.g. images:debian/12/cloud), "+
		"or run 'sudo claudebox image build' (Debian 12 with cloud-init, built with debootstrap from this host's apt mirror) and pass --image %s "+
		"(a container 'new' without --image uses it)", ref, DefaultLocalImage())
}

// probeTimeout bounds the reachability check of an image server before `new` creates anything.
var probeTimeout = 8 * time.Second

// checkImageServer asks the image server of a remote image ref whether it answers, before
// anything is made, so that an unreachable server is reported as such (not as the daemon's
// "Failed getting remote image info" after a create was started). Any HTTP answer counts as
// reachable, and so does a TLS failure (the daemon has its own trust store and proxy
// settings); only a failure to resolve the name or to connect is an error.
func checkImageServer(ctx context.Context, ref string, src incus.InstanceSource) error {
	u, err := url.Parse(src.Server)
	if err != nil || u.Host == "" {
		return nil // the daemon judges what it is given
	}
	probe := strings.TrimSuffix(src.Server, "/") + "/1.0"
	if src.Protocol == "simplestreams" {
		probe = strings.TrimSuffix(src.Server, "/") + "/streams/v1/index.json"
	}
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodHead, probe, nil)
	if err != nil {
		return nil
	}
	tr := &http.Transport{Proxy: http.ProxyFromEnvironment, DialContext: (&net.Dialer{Timeout: probeTimeout}).DialContext,
		TLSHandshakeTimeout: probeTimeout}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
	if err == nil {
		resp.Body.Close()
		return nil
	}
	if ctx.Err() != nil {
		return nil // interrupted: New says so
	}
	var dnsErr *net.DNSError
	var opErr *net.OpError
	if !errors.As(err, &dnsErr) && !(errors.As(err, &opErr) && opErr.Op == "dial") && !errors.Is(err, context.DeadlineExceeded) {
		return nil // it answered something (TLS, HTTP): let the daemon decide
	}
	remote, _, _ := strings.Cut(ref, ":")
	why := err.Error()
	if errors.As(err, &dnsErr) {
		why = "cannot resolve " + dnsErr.Name
	} else if errors.As(err, &opErr) && opErr.Err != nil {
		why = opErr.Err.Error()
	} else if errors.Is(err, context.DeadlineExceeded) {
		why = fmt.Sprintf("no answer within %s", probeTimeout)
	}
	return Usagef("new: the image server of %q is unreachable (remote %q, %s: %s): nothing was created. "+
		"On a host without an image server, build a local image with 'sudo claudebox image build' (a container 'new' without --image then uses it), "+
		"or pass --image with a local alias ('incus image list')", ref, remote, u.Host, why)
}
